"""Training and scoring runs from Python: the same settings as ``train.toml`` and
``score.toml``, run by the ``regatta`` binary's ``train``/``score`` against this driver's
cluster, progress lines printed as they come, the summary returned."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from .exceptions import RegattaError


def _toml_value(value, where):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{where}: {value} has no TOML form")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v, f'{where}.{k}')}" for k, v in value.items()) + " }"
    raise TypeError(f"{where}: a {type(value).__name__} cannot go into the configuration")


# Maps that stay inline tables (`resources = { CPU = 1 }`) rather than becoming sections.
_INLINE = {"resources", "env", "metadata", "env_vars"}


def to_toml(config, _prefix=""):
    """A configuration dict as TOML: plain keys first, then each nested dict as a table."""
    lines, tables = [], []
    for key, value in config.items():
        if not isinstance(key, str):
            raise TypeError(f"configuration keys are strings, not {key!r}")
        if value is None:
            continue
        if isinstance(value, dict) and key not in _INLINE:
            tables.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {_toml_value(value, _prefix + key)}")
    out = "\n".join(lines)
    for key, value in tables:
        name = f"{_prefix}{key}"
        out += f"\n\n[{name}]\n" + to_toml(value, name + ".")
    return out.strip() + "\n"


def _binary():
    binary = os.environ.get("REGATTA_BIN") or shutil.which("regatta")
    if not binary:
        raise RegattaError("cannot find the regatta binary: set REGATTA_BIN or put regatta on PATH")
    return binary


def _run(kind, config, extra):
    from . import _current

    driver = _current()
    if isinstance(config, (str, os.PathLike)):
        path, cleanup = os.fspath(config), None
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {kind} configuration at {path}")
    elif isinstance(config, dict):
        handle, path = tempfile.mkstemp(prefix=f"regatta-{kind}-", suffix=".toml")
        with os.fdopen(handle, "w") as f:
            f.write(to_toml(config))
        cleanup = path
    else:
        raise TypeError(f"the {kind} configuration is a dict or a TOML file's path, not {type(config).__name__}")
    env = dict(os.environ)
    env["REGATTA_TOKEN"] = driver.token
    command = [_binary(), kind, "--config", path, "--address", driver.cluster.address, "--json", *extra]
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        summary, tail = None, []
        for line in process.stdout:
            stripped = line.strip()
            if stripped.startswith("{") and stripped.endswith("}"):
                try:
                    summary = json.loads(stripped)
                    continue
                except ValueError:
                    pass
            tail = (tail + [line])[-20:]
            sys.stdout.write(line)
            sys.stdout.flush()
        code = process.wait()
    finally:
        if cleanup:
            os.unlink(cleanup)
    if code != 0 or summary is None:
        raise RegattaError(f"the {kind} run failed (exit {code}):\n{''.join(tail)}")
    return summary


def train(config):
    """Runs a training (``train.toml``'s settings as a dict, or its path) on this driver's
    cluster; returns the summary (``steps``, ``losses``, ``tokens_per_sec``, ...)."""
    return _run("train", config, [])


def score(config):
    """Runs a scoring or generation run (``score.toml``'s settings as a dict, or its path)
    on this driver's cluster; returns the summary (``rows``, ``errors``, ``seconds``, ...)."""
    return _run("score", config, [])
