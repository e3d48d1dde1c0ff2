"""Every command's --help is plain text and documents every option."""

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", ["demo", "bench", "doctor"])
def test_help_is_plain_and_every_option_documented(command):
    out = subprocess.run([sys.executable, "-m", "extsrc", command, "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "``" not in text and ":class:" not in text
    lines = text.splitlines()
    options = [i for i, line in enumerate(lines) if re.match(r"^  -", line)]
    assert options
    for i in options:
        described = re.search(r"\S\s{2,}\S", lines[i].strip()) is not None
        continued = i + 1 < len(lines) and re.match(r"^\s{8,}\S", lines[i + 1]) is not None
        assert described or continued, f"undocumented option in {command} --help: {lines[i]!r}"


def test_a_reader_that_stops_early_ends_the_command_quietly():
    # `python -m extsrc doctor | head -3`: the pipe closes before doctor has written; that
    # ends the command with the shell's code for SIGPIPE, not with a traceback.
    proc = subprocess.Popen([sys.executable, "-m", "extsrc", "doctor"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode() and "BrokenPipeError" not in err.decode(), err.decode()
    assert proc.returncode == 141


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(tmp_path):
    # Only a closed stdout ends a command quietly; a BrokenPipeError from another pipe (a
    # socket, a subprocess) is the command's error and keeps its traceback and exit code.
    script = tmp_path / "run.py"
    script.write_text(
        "import runpy, socket, sys\n"
        "import extsrc.cli.doctor as doctor\n"
        "def broken(argv):\n"
        "    a, b = socket.socketpair(); b.close(); a.send(b'x' * 100000); a.send(b'x')\n"
        "doctor.main = broken\n"
        "sys.argv = ['extsrc', 'doctor']\n"
        "runpy.run_module('extsrc', run_name='__main__')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "BrokenPipeError" in done.stderr and done.returncode == 1, (done.returncode, done.stderr)
