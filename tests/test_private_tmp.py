"""Fixed names under /tmp are reused only when this user made them and no one else can write them."""

from __future__ import annotations

import os
import tempfile

import pytest

from torchloom.etl.session import _log4j_file
from torchloom.private import private_dir, private_file

OTHER_UID = 54321


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    shared = tmp_path / "shared-tmp"
    shared.mkdir(mode=0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


def test_the_log4j_config_is_not_taken_from_a_file_another_user_planted(tmp):
    first = _log4j_file()  # a fresh machine: the fixed name is made, private
    assert os.path.dirname(first) == str(tmp) and _log4j_file() == first  # and reused
    os.unlink(first)
    with open(first, "w") as f:
        f.write("rootLogger.level = off\n")  # planted by someone else
    if os.geteuid() == 0:
        os.chown(first, OTHER_UID, OTHER_UID)
    path = _log4j_file()
    assert path != first and open(path).read().startswith("rootLogger.level = warn")
    assert open(first).read() == "rootLogger.level = off\n"  # theirs, untouched


def test_a_planted_symlink_or_writable_file_is_not_followed(tmp):
    target = tmp / "victim"
    target.write_text("precious")
    (tmp / "cfg").symlink_to(target)
    path = private_file("cfg", "ours")
    assert path != tmp / "cfg" and path.read_text() == "ours" and target.read_text() == "precious"
    (tmp / "open").write_text("ours")
    os.chmod(tmp / "open", 0o666)
    assert private_file("open", "ours") != tmp / "open"


def test_a_session_dir_is_reused_only_when_private_and_ours(tmp):
    made = private_dir("torchloom-ray-test")
    assert made == tmp / "torchloom-ray-test" and (made.stat().st_mode & 0o777) == 0o700
    assert private_dir("torchloom-ray-test") == made
    (tmp / "planted").mkdir(mode=0o777)
    os.chmod(tmp / "planted", 0o777)
    fresh = private_dir("planted")
    assert fresh != tmp / "planted" and (fresh.stat().st_mode & 0o077) == 0
    if os.geteuid() == 0:
        (tmp / "theirs").mkdir(mode=0o700)
        os.chown(tmp / "theirs", OTHER_UID, OTHER_UID)
        assert private_dir("theirs") != tmp / "theirs"
