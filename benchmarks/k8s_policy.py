"""The manifests of `torchloom k8s` through a policy scanner: checkov's Kubernetes checks (issue 61).

    python benchmarks/k8s_policy.py [--checkov PATH]

Writes the train and serve manifests of a platform team's flags (a private registry, a service account, a Kueue
queue, CPU and memory) and of the defaults alone, runs `checkov --framework kubernetes` on them, and prints one
row per failed check: the check, the objects, and the reason it is accepted (EXCEPTIONS), or "NOT ACCEPTED". Exit
status 1 if any failed check is not accepted. checkov is not one of torchloom's dependencies (it pins packages of
its own): install it into a venv of its own (`python -m venv /tmp/checkov && /tmp/checkov/bin/pip install
checkov`) and pass --checkov /tmp/checkov/bin/checkov. Results: docs/engines.md, "What a policy scanner says".
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The checks the manifests fail on purpose, each with its reason (docs/engines.md repeats them).
EXCEPTIONS = {
    "CKV_K8S_43": "the image is the user's (--image): give it by digest (REPO@sha256:...) to pass this",
    "CKV_K8S_11": "no CPU limit on purpose: a limit throttles the data loader and the collectives (CFS quota);"
                  " the request is --cpu",
    "CKV_K8S_10": "the CPU request is --cpu; without it the cluster's defaults (a LimitRange) apply",
    "CKV_K8S_12": "the memory request is --memory; without it the cluster's defaults (a LimitRange) apply",
    "CKV_K8S_13": "the memory limit is --memory (the request too); without it the cluster's defaults apply",
    "CKV_K8S_21": "the namespace is --namespace; without it `default`, kubectl's own",
    "CKV_K8S_35": "secrets as environment variables (envFrom): the store's SDKs and torchloom read them there",
    "CKV2_K8S_6": "a NetworkPolicy is the cluster's to write (which namespaces may reach the server)",
}

PLATFORM = ["--image", "registry.corp/ml/torchloom:0.1", "--image-pull-secret", "regcred",
            "--service-account", "trainer-s3", "--label", "kueue.x-k8s.io/queue-name=gpu-queue",
            "--cpu", "8", "--memory", "32Gi", "--namespace", "ml"]
CASES = {
    "train-defaults": ["train", "--image", "registry.corp/ml/torchloom:0.1", "--output.dir", "s3://b/runs/x"],
    "train-platform": ["train", *PLATFORM, "--nodes", "2", "--output.dir", "s3://b/runs/x", "--secret", "store"],
    "serve-defaults": ["serve", "s3://b/runs/x/model", "--image", "registry.corp/ml/torchloom:0.1",
                       "--secret", "serve-secrets"],
    "serve-platform": ["serve", "s3://b/runs/x/model", *PLATFORM, "--secret", "serve-secrets", "--replicas", "2"],
}


def scan(checkov: str, directory: Path) -> list[dict]:
    done = subprocess.run([checkov, "-d", str(directory), "--framework", "kubernetes", "-o", "json", "--compact",
                           "--quiet", "--skip-download"], capture_output=True, text=True)
    report = json.loads(done.stdout or "{}")
    reports = report if isinstance(report, list) else [report]
    return [c for r in reports for c in r.get("results", {}).get("failed_checks", [])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkov", default=shutil.which("checkov") or "checkov")
    args = p.parse_args()
    from torchloom.k8s.command import main as k8s

    failed: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, argv in CASES.items():
            out = Path(tmp) / case
            assert k8s([*argv, "--out", str(out)]) == 0, case
            for check in scan(args.checkov, out):
                failed.setdefault(check["check_id"], set()).add(f"{case}:{check['resource']}")
                names[check["check_id"]] = check["check_name"]
    print(f"checkov on {len(CASES)} sets of manifests: {len(failed)} checks failed")
    print(f"{'check':<12} {'accepted':<9} {'where':<48} reason / check")
    bad = 0
    for check, where in sorted(failed.items()):
        reason = EXCEPTIONS.get(check)
        bad += reason is None
        print(f"{check:<12} {'yes' if reason else 'NO':<9} {', '.join(sorted(where))[:48]:<48}"
              f" {reason or names[check]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
