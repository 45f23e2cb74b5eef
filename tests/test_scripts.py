"""Entry-point scripts mark their required flags in `__main__` only: a program that imports
one (a test, a notebook) and then parses its own flags — as tokamax does on first use — must
not fail on the script's validators."""

import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

# Scripts whose flag names do not collide (several scripts define --workdir or --out).
_SCRIPTS = ("train_tokenizer", "held_out_image")


def test_imported_scripts_leave_flag_parsing_working():
  code = "\n".join(["from tests.conftest import load_script",
                    *(f"load_script({name!r})" for name in _SCRIPTS),
                    "from absl import flags",
                    "flags.FLAGS(['prog'], known_only=True)",
                    "print('parsed', flags.FLAGS.is_parsed(), flags.FLAGS.output)"])
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.split() == ["parsed", "True", "None"]


def test_a_script_run_without_its_required_flag_names_it():
  run = subprocess.run([sys.executable, "scripts/plot_metrics.py"], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert run.returncode != 0
  assert "--workdir" in run.stderr and "--out" in run.stderr
