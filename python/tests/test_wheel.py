"""The wheel scripts/build-wheel.sh makes is the whole set-up: installed alone, with no
REGATTA_BIN and no `regatta` on PATH, it starts a local cluster from the binary it carries,
and `python -m regatta` is the command line."""

import os
import subprocess
import sys
import textwrap
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_wheel_carries_the_binary_and_runs_a_cluster_with_nothing_else(tmp_path):
    built = subprocess.run(["bash", "scripts/build-wheel.sh", "--debug", "--out", str(tmp_path / "dist")],
                           cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = built.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        mode = archive.getinfo("regatta/bin/regatta").external_attr >> 16
    assert mode & 0o111, f"the bundled binary is not executable in the wheel (mode {mode:o})"
    assert not os.path.exists(os.path.join(ROOT, "python", "regatta", "bin")), "the build left the binary behind"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), wheel],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REGATTA_BIN", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    env["PATH"] = "/usr/bin:/bin"  # no regatta here
    script = textwrap.dedent(f"""
        import regatta
        assert regatta.__file__.startswith({str(site)!r}), regatta.__file__
        assert regatta._binary() == {str(site / "regatta" / "bin" / "regatta")!r}, regatta._binary()
        regatta.init(num_cpus=1)

        @regatta.remote
        def cube(x):
            return x ** 3

        print("sum", sum(regatta.get([cube.remote(i) for i in range(10)])))
        regatta.shutdown()
    """)
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "sum 2025" in ran.stdout
    cli = subprocess.run([sys.executable, "-m", "regatta", "--help"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert cli.returncode == 0 and "Usage" in cli.stdout, cli.stdout + cli.stderr
