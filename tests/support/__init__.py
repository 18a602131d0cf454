"""What the test modules share besides fixtures (those are in tests/conftest.py). Import the module you need:

- support.net: free_port, a TCP port free on 127.0.0.1
- support.owned: the CLI, its one error line and foreign projects for the --overwrite and ledger tests
- support.s3: s3_server, a real S3 server (moto's) for the storage tests
- support.spark_jvm: the options of every Spark JVM the suite starts (JVM_ENV) and their class-data archive
- support.engine_reference: the reference job the engine tests share (the local engine's run, bit for bit)
- support.schedule: the pytest plugin that says which tests share an xdist worker, and which start first
  (tests/conftest.py loads it; the markers it reads are in pyproject.toml and tests/README.md)

Nothing here is collected as a test: no module is named test_*.
"""
