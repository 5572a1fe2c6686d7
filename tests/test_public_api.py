"""The public surface: documented names, where they live, and no optional imports."""

from __future__ import annotations

import subprocess
import sys

import nanguard

DOCUMENTED = {
    "watch",
    "Guard",
    "Event",
    "TensorStats",
    "NonFiniteError",
    "NonFiniteWarning",
    "NanguardError",
    "AttachError",
    "Options",
    "read_events",
    "unwatch",
    "PHASES",
    "KINDS",
}


def test_every_documented_name_is_exported() -> None:
    assert set(nanguard.__all__) == DOCUMENTED
    for name in DOCUMENTED:
        assert hasattr(nanguard, name), name


def test_exceptions_belong_to_the_public_package() -> None:
    for cls in (nanguard.NonFiniteError, nanguard.NonFiniteWarning, nanguard.NanguardError):
        assert cls.__module__ == "nanguard"


def test_import_does_not_pull_optional_frameworks() -> None:
    # Measured against `import torch` alone: some environments' torch imports tqdm itself.
    code = (
        "import sys, torch\n"
        "heavy = ('lightning', 'pytorch_lightning', 'transformers', 'matplotlib', 'rich', 'tqdm')\n"
        "before = {m for m in heavy if m in sys.modules}\n"
        "import nanguard\n"
        "sys.exit(sum(m in sys.modules and m not in before for m in heavy))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_import_configures_no_logging_handler() -> None:
    code = (
        "import logging, sys, nanguard\n"
        "sys.exit(len(logging.getLogger('nanguard').handlers) + len(logging.getLogger().handlers))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
