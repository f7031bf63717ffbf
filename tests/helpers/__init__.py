"""Helpers shared by every test folder (importable as `helpers`: pyproject's pytest
`pythonpath` puts tests/ on sys.path).

- waiting: `wait_for` / `eventually`, the one poll-until-true-with-a-deadline;
- cli: `run_cli` / `run_cli_async`, the one runner of the `inboxd` command line;
- mail: `store_mail`, received messages ingested through the real IngestStage (for
  folders without tests/pipeline's factories);
- keys: self-signed certificates and SNS signatures made independently of the code;
- db: `fetch` / `fetchval` / `count` / `rows_in` / `extraction_jobs`, the reads a test
  asserts on, from a pool or a DSN;
- config_files: `write_config_tree` / `write_tenant_file`, a main file and tenants/*.toml;
- moto_server: the `moto_endpoint` session fixture (moto's S3/SQS server, fake AWS
  credentials), registered for every folder by tests/conftest.py.

Other fixtures stay in the conftest.py of the folder that needs them; what the tests
of one folder share beyond that lives in a rig module there (tests/daemon/harness.py,
*_rig.py), never in a test module (tests/test_layering.py checks).
"""

from helpers.cli import CLI_TIMEOUT_S, CliResult, cli_argv, cli_env, run_cli, run_cli_async
from helpers.waiting import WaitTimeout, eventually, wait_for

__all__ = [
    "CLI_TIMEOUT_S",
    "CliResult",
    "WaitTimeout",
    "cli_argv",
    "cli_env",
    "eventually",
    "run_cli",
    "run_cli_async",
    "wait_for",
]
