"""Every `kvpp` subcommand under hostile command lines (hypothesis): never a traceback, never a
signal sent, and bad input always ends in `kvpp: error: ...` lines with exit code 2.

The CLI runs in-process (deploy.cli.main), so hundreds of inputs take seconds; what would start
servers or build models is replaced by a stub that raises `Reached` once every option has been
parsed and validated. A few cases also run the real command in a subprocess.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.cli import main as cli
from tests.helpers.paths import REPO as ROOT

pytestmark = pytest.mark.unit

EXAMPLES = sorted(str(p) for p in (ROOT / "deploy" / "deployment" / "examples").glob("*.yaml"))
EXAMPLES_PER_COMMAND = 250
FUZZ = settings(max_examples=EXAMPLES_PER_COMMAND, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Reached(Exception):
    """The command got past its validation to the part that would start something."""


def _reached(*_args, **_kwargs):
    raise Reached


def _no_signals(*args, **kwargs):
    raise AssertionError(f"a fuzzed command tried to send a signal: {args}")


def stub_out(mp: pytest.MonkeyPatch, workdir: Path) -> None:
    """Stubs for everything long-running or process-affecting; `workdir` becomes the working directory."""
    import deploy.harness.demo
    import deploy.cli.plan
    import deploy.services.pool
    import deploy.services.proxy
    import deploy.harness.tiny_model

    mp.chdir(workdir)
    mp.setattr(deploy.services.pool, "DEFAULT_STATE_DIR", workdir / "default-state")
    for module, name in ((deploy.services.proxy.web, "run_app"), (deploy.services.pool, "start_mooncake"),
                         (deploy.services.pool, "start_memcache"), (deploy.harness.demo, "run_demo"),
                         (deploy.harness.tiny_model, "_hf_config"), (deploy.cli.plan, "plot_ratio_vs_tp")):
        mp.setattr(module, name, _reached)
    for module, name in ((os, "kill"), (os, "killpg"), (signal, "pidfd_send_signal")):
        mp.setattr(module, name, _no_signals)
    mp.setattr(signal, "signal", lambda *a: None)  # the demo installs a SIGTERM handler


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Stubs in place, and paths of every kind."""
    stub_out(monkeypatch, tmp_path)
    (tmp_path / "file.txt").write_text("not yaml: [")
    (tmp_path / "big.yaml").write_bytes(b"#" * (2 << 20))
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "full")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "state").mkdir()
    return tmp_path


def run(argv: list[str]) -> tuple[int | None, str, str]:
    """Exit code (None when a stub was reached), stdout and stderr of one in-process run."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except Reached:
            code = None
    return code, out.getvalue(), err.getvalue()


def check_outcome(argv: list[str], bad: bool, code: int | None, err: str, check_style: bool = False,
                  out: str = "") -> None:
    assert "Traceback" not in err, (argv, err)
    lines = err.splitlines()
    if code == 2:
        assert out == "", (argv, out)
        assert lines and all(ln.startswith(("kvpp: error: ", "kvpp: warning: ")) for ln in lines), (argv, err)
        assert any(ln.startswith("kvpp: error: ") for ln in lines), (argv, err)
    elif code == 1 and check_style:  # `kvpp check`: the spec has errors, one line each
        assert lines and all(ln.startswith(("error: ", "warning: ")) for ln in lines), (argv, err)
    else:
        assert code in (0, None) and not bad, (argv, code, err)
    if bad:
        assert code in ((1, 2) if check_style else (2,)), (argv, code, err)


# ---- value strategies: (text, is_bad) -------------------------------------------------------------
def good(strategy):
    return strategy.map(lambda v: (str(v), False))


def bad(strategy):
    return strategy.map(lambda v: (str(v), True))


def _parses(kind):
    def test(text: str) -> bool:
        try:
            kind(text)
            return True
        except ValueError:
            return False
    return test


JUNK = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="-"), min_size=1, max_size=12)
NUMBERISH_BAD = st.sampled_from(["nan", "NaN", "inf", "-inf", "1e308", "1e999", "", " ", "0x10", "1.5e", "--"])


def ints(low: int, high: int):
    return st.one_of(
        good(st.integers(low, min(high, low + 64))),
        bad(st.integers(max_value=low - 1)), bad(st.integers(min_value=high + 1, max_value=high + 10**30)),
        bad(JUNK.filter(lambda s: not _parses(int)(s))), bad(NUMBERISH_BAD),
    )


def numbers(high: float):
    return st.one_of(
        good(st.floats(0.001, high, allow_nan=False)),
        bad(st.floats(max_value=0.0, allow_nan=False)), bad(st.floats(min_value=high * 2, allow_infinity=True)),
        bad(NUMBERISH_BAD.filter(lambda s: s not in ("0x10",))), bad(JUNK.filter(lambda s: not _parses(float)(s))),
    )


PORTS = ints(1, 65535)
SIZES = ints(1, 1024)
SECONDS = numbers(7 * 24 * 3600)
HOSTS = st.one_of(
    good(st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "localhost", "node-1.example.com"])),
    bad(st.sampled_from(["a b", "a\nb", "$(touch x)", "`id`", "a;b", "", "h\x00", "x" * 300, "under_score"])),
)
URLS = st.one_of(
    good(st.sampled_from(["http://127.0.0.1:8100", "http://a:1,http://b:2", "https://node-1:443/v1"])),
    bad(st.sampled_from(["ftp://x", "http://", "http://a b", "http://h:99999", "http://h:0", "x", ",", "http://$(id)",
                         "http://[::1", "http://h\n:1"])),
)


JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _example_with(path: str, where: str, value) -> str:
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    target = data["prefill"][0] if where.startswith("prefill.") else data
    target[where.split(".")[-1]] = value
    return yaml.safe_dump(data)


SPEC_TEXTS = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200),
    st.sampled_from(["a: &a [*a]", "x: !!python/object:os.system 'id'", "[" * 5000, "a: &x [1]\nb: [*x, *x]",
                     "model: {path: 2020-01-01}", "{1: 2}", "model: {path: .nan}"]),
    st.builds(_example_with, st.sampled_from(EXAMPLES),
              st.sampled_from(["model", "prefill", "pool", "proxy", "kubernetes", "prefill.env", "prefill.hosts",
                               "prefill.extra_args", "prefill.tp", "prefill.memory", "prefill.additional_config",
                               "prefill.name", "prefill.kv_port"]), JSONISH),
)


def paths(sandbox: Path, good_names: list[str], bad_names: list[str]):
    bad_paths = bad(st.sampled_from([str(sandbox / n) for n in bad_names] + ["", "a\x00b", "x\ny"]))
    return st.one_of(good(st.sampled_from([str(sandbox / n) for n in good_names])), bad_paths) if good_names else bad_paths


def argv_for(draw, command: list[str], options: dict, required: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    argv, any_bad = list(command), False
    for flag, values in options.items():
        if flag not in required and draw(st.booleans()):
            continue
        value, is_bad = draw(values)
        if flag.startswith("--"):
            argv += [f"{flag}={value}"]  # `=` keeps values that start with '-' attached to their flag
        else:
            argv.append(value)
        any_bad |= is_bad
    return argv, any_bad


def fuzz(command: list[str], options_fn, required: tuple[str, ...] = (), check_style: bool = False,
         flags=st.just([]), minimum: int = int(EXAMPLES_PER_COMMAND * 0.8)) -> int:
    tried = []

    @FUZZ
    @given(st.data())
    def one(data):
        argv, is_bad = argv_for(data.draw, command, options_fn(), required)
        argv += data.draw(flags)
        code, out, err = run(argv)
        check_outcome(argv, is_bad, code, err, check_style, out)
        tried.append(argv)

    one()
    print(f"{' '.join(command)}: {len(tried)} command lines tried")
    assert len(tried) >= minimum
    return len(tried)


# ---- one test per subcommand ----------------------------------------------------------------------
def test_plan(sandbox):
    (sandbox / "cfg").mkdir(exist_ok=True)
    (sandbox / "cfg" / "config.json").write_text('{"model_type": "deepseek_v3", "num_hidden_layers": 1e999}')
    models = st.one_of(good(st.sampled_from(["glm-5.2", "deepseek-v3", "kvpp-tiny"])),
                       bad(st.sampled_from([str(sandbox / "fifo"), str(sandbox / "big.yaml"), str(sandbox / "cfg"),
                                            "/dev/zero", "gpt-9", str(sandbox / "binary.yaml")])))
    lists = st.one_of(good(st.sampled_from(["38,40", "61", "1,1"])),
                      bad(st.sampled_from(["38,x", ",", "1e308", "0,78", "-1", "1" + ",1" * 5000])))
    fuzz(["plan"], lambda: {
        "--model": models, "--tp": SIZES, "--pp": SIZES, "--pp-layers": lists, "--pcp": SIZES,
        "--mtp": ints(0, 64), "--kv-dtype": st.one_of(good(st.just("fp8")), bad(st.just("fp7"))),
        "--memory-gib": st.one_of(numbers(1 << 20), bad(st.just("1,nan")), good(st.just("60,64"))),
        "--block-size": ints(1, 1 << 20), "--staging": st.one_of(good(st.sampled_from([0, 1, 2, 3])), bad(JUNK.filter(lambda s: not _parses(int)(s)))),
        "--plot": st.one_of(good(st.just(str(sandbox / "p.png"))), bad(st.sampled_from(["x.foo", "", "a\nb.png"]))),
    }, required=("--model", "--tp"), flags=st.sampled_from([[], ["--json"]]))


def test_ports(sandbox):
    nodes = st.one_of(good(st.sampled_from(["p=37000:2", "d=37010:1:1:1:1"])),
                      bad(st.sampled_from(["p=99999:1", "p=1:0", "x", "=1:1", "p=1:1:1:1:1:1", "p=1:99999999999",
                                           "p\n=1:1", "p=nan:1"])))
    specs = paths(sandbox, [], ["fifo", "big.yaml", "nope.yaml", "full", "binary.yaml", "file.txt"])
    fuzz(["ports"], lambda: {"--kv-port": PORTS, "--tp": SIZES, "--pp": SIZES, "--pcp": SIZES, "--dp": SIZES,
                             "--node": nodes, "--spec": specs}, flags=st.sampled_from([[], ["--json"]]))


def test_proxy(sandbox):
    fuzz(["proxy"], lambda: {"--prefill": URLS, "--decode": URLS, "--host": HOSTS, "--port": PORTS,
                             "--connect-timeout": SECONDS, "--prefill-timeout": SECONDS, "--decode-timeout": SECONDS},
         required=("--prefill", "--decode", "--port"))


def test_check_and_render(sandbox):
    spec_paths = st.one_of(good(st.sampled_from(EXAMPLES)),
                           bad(st.sampled_from([str(sandbox / n) for n in ("fifo", "big.yaml", "nope.yaml", "full",
                                                                          "binary.yaml", "file.txt")])))
    fuzz(["check"], lambda: {"spec": spec_paths}, required=("spec",), check_style=True, minimum=9)
    generated = sandbox / "generated.yaml"
    tried = []

    @FUZZ
    @given(SPEC_TEXTS, st.sampled_from(["check", "render"]))
    def content(text, command):
        generated.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        argv = [command, str(generated)] + (["--out", str(sandbox / "gen-out")] if command == "render" else [])
        code, out, err = run(argv)
        check_outcome(argv, False, code, err, command == "check", out)
        tried.append(text)

    content()
    print(f"check/render: {len(tried)} generated spec files tried")
    assert len(tried) >= EXAMPLES_PER_COMMAND * 0.8
    outs = st.one_of(good(st.builds(lambda n: str(sandbox / f"out{n}"), st.integers(0, 3))),
                     bad(st.sampled_from([str(sandbox / n) for n in ("full", "link", "file.txt")] + ["", "o\nut"])))
    fuzz(["render"], lambda: {"spec": spec_paths, "--format": st.one_of(good(st.sampled_from(["shell", "k8s"])),
                                                                        bad(st.just("helm"))), "--out": outs},
         required=("spec", "--out"))
    assert (sandbox / "full" / "notes.txt").read_text() == "mine" and sorted(os.listdir(sandbox / "full")) == [
        "notes.txt"]


def test_pool(sandbox):
    state = sandbox / "state" / "pool.json"
    contents = st.one_of(st.binary(max_size=64), st.sampled_from([
        b"{}", b"[]", b'{"pids": [1]}', b'{"pids": [-1, 0]}', b"null",
        b'{"backend": "mooncake", "kv_connector_extra_config": {}, "processes": [{"pid": 1, "start_ticks": 0, '
        b'"cmdline": ["x"]}], "boot_id": "b", "state_dir": "s"}',
        b'{"backend": "mooncake", "kv_connector_extra_config": {}, "processes": [{"pid": 99999999999, '
        b'"start_ticks": 0, "cmdline": ["x"]}], "boot_id": "b", "state_dir": "s"}',
        b'{"backend": "mooncake", "kv_connector_extra_config": {}, "processes": [], "boot_id": "b", "state_dir": "s"}',
        b'{"backend": "mooncake", "kv_connector_extra_config": {}, "processes": [{"pid": 4000000, "start_ticks": 0, '
        b'"cmdline": ["x"]}], "boot_id": "b", "state_dir": "s", "extra": 1}',
    ]))
    tried = []

    @FUZZ
    @given(contents)
    def down(content):
        state.write_bytes(content)
        code, _out, err = run(["pool", "down", "--state-dir", str(state.parent)])
        check_outcome(["pool", "down", repr(content)], True, code, err)
        assert len(err.splitlines()) == 1
        tried.append(content)

    down()
    print(f"pool down: {len(tried)} state files tried")
    assert len(tried) >= EXAMPLES_PER_COMMAND * 0.8
    dirs = paths(sandbox, ["state", "newdir"], ["file.txt"])
    fuzz(["pool", "up"], lambda: {
        "--backend": st.one_of(good(st.sampled_from(["mooncake", "memcache"])), bad(st.just("redis"))),
        "--segment-size": st.one_of(good(st.sampled_from(["512MB", "2GB", "1048576"])),
                                    bad(st.sampled_from(["0GB", "1KB", "99999999999999999999GB", "1.5GB", "GB", "x",
                                                         "2TB", "１GB"]))),
        "--state-dir": st.one_of(dirs.filter(lambda v: v[1]), good(st.just(str(sandbox / "state")))),
    }, required=("--backend",), flags=st.sampled_from([[], ["--json"]]))


def test_tiny_model_and_demo(sandbox):
    targets = st.one_of(good(st.sampled_from([str(sandbox / "new-model"), str(sandbox / "state" / "m")])),
                        bad(st.sampled_from([str(sandbox / n) for n in ("full", "file.txt", "link")] + ["", "a\nb"])))
    fuzz(["tiny-model"], lambda: {"path": targets, "--layers": ints(1, 256), "--seed": ints(0, (1 << 63) - 1),
                                  "--mtp": ints(0, 8)}, required=("path",), flags=st.sampled_from([[], ["--moe"]]))
    assert sorted(os.listdir(sandbox / "full")) == ["notes.txt"]
    fuzz(["demo"], lambda: {"--workdir": st.one_of(good(st.just(str(sandbox / "demo"))),
                                                   bad(st.sampled_from([str(sandbox / "file.txt"), "", "a\x00"])))},
         flags=st.sampled_from([[], ["--json"]]), minimum=8)  # a small space: hypothesis stops when it is exhausted


def test_arbitrary_words_never_raise():
    """Any argv at all: an exit code and one-line errors, never an exception (a stub may be reached
    by luck, which is allowed here)."""
    tried = []

    @FUZZ
    @given(st.sampled_from([[], ["plan"], ["ports"], ["check"], ["render"], ["proxy"], ["pool"], ["pool", "up"],
                            ["pool", "down"], ["tiny-model"], ["demo"]]),
           st.lists(st.text(max_size=20), max_size=8))
    def one(command, words):
        code, out, err = _run_isolated(command + words)
        assert "Traceback" not in err and code in (0, 1, 2, None)
        if code == 2:
            assert out == "" and all(ln.startswith(("kvpp: error: ", "kvpp: warning: ", "error: ", "warning: "))
                                     for ln in err.splitlines())
        tried.append(words)

    one()
    print(f"arbitrary words: {len(tried)} command lines tried")
    assert len(tried) >= EXAMPLES_PER_COMMAND * 0.8


def _run_isolated(argv):
    """Run in a scratch working directory: random words may well name an output directory."""
    import tempfile

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as scratch:
        stub_out(mp, Path(scratch))
        return run(argv)


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "glm-5.2", "--tp", "8", "--memory-gib", "1e308"], "argument --memory-gib"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "99999"], "argument --port"),
    (["proxy", "--prefill", "http://a:1", "--decode", "http://b:1", "--port", "8000", "--connect-timeout", "nan"],
     "argument --connect-timeout"),
    (["check", "/dev/zero"], "not a regular file"),
])
def test_real_command_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "deploy.cli.main", *argv], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpp: error: ") and message in lines[0], proc.stderr
