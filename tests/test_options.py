"""The option table (jax_ssdtrain/_src/options): everything derived from it agrees with it
(StoreConfig, configure(), the environment, the engine's settings, the docs page), the engine
has no defaults of its own, and the store stays closed after shutdown()."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jax_ssdtrain as ssd
from jax_ssdtrain._src import config, native, options, planner

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
OPTION_NAMES = [o.name for o in options.OPTIONS]

# A value other than the default for every option that has a variable: (the variable's text,
# the field's value). A new option needs a line here (test_every_variable_is_read checks).
ENV_SAMPLES = {
  "directories": ("{tmp}/a:{tmp}/b", ("{tmp}/a", "{tmp}/b")),
  "capacity_bytes": ("300MiB", 300 * MiB),
  "host_cache_bytes": ("48MiB", 48 * MiB),
  "host_tier_bytes": ("24MB", 24_000_000),
  "staging_bytes": ("0", 0),
  "staging_max_bytes": ("3GiB", 3 << 30),
  "io_threads": ("3", 3),
  "chunk_bytes": ("128KiB", 128 << 10),
  "prefetch_bytes": ("2M", 2 * MiB),
  "o_direct": ("off", False),
  "gds": ("on", True),
  "forwarding": ("no", False),
  "on_full": ("KEEP", "keep"),
  "verify": ("1", True),
  "exact_loads": ("yes", True),
  "bandwidth_cap": ("7GB/s", 7_000_000_000),
}

# A bad value of every option for configure() (its keyword is the first one).
BAD_VALUES = {
  "directories": 42,
  "capacity_bytes": "lots",
  "host_cache_bytes": 0,
  "host_tier_bytes": -1,
  "staging_bytes": "1.5 parsecs",
  "staging_max_bytes": "auto",
  "io_threads": 257,
  "chunk_bytes": 5000,
  "prefetch_bytes": True,
  "o_direct": "maybe",
  "gds": 2,
  "forwarding": None,
  "on_full": "panic",
  "verify": "sometimes",
  "exact_loads": 0.5,
  "bandwidth_cap": "fast",
  "device_groups": -3,
}


@pytest.fixture
def clean_env(monkeypatch):
  for o in options.OPTIONS:
    if o.env:
      monkeypatch.delenv(o.env, raising=False)
  return monkeypatch


def _offloading_step(scale=1.0):
  def loss(w, x):
    h = checkpoint_name(jnp.sin(x @ w), "h")
    return scale * jnp.sum(h * h)

  policy = ssd.offload_policy(["h"], min_bytes=0)
  return jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))


def _inputs():
  return jnp.ones((16, 16)) * 0.1, jnp.ones((8, 16))


# ---------------------------------------------------------------------------------------------
# The table and what is derived from it


def test_store_config_is_the_table():
  fields = dataclasses.fields(ssd.StoreConfig)
  assert [f.name for f in fields] == OPTION_NAMES
  cfg = ssd.StoreConfig()
  for o in options.OPTIONS:
    assert getattr(cfg, o.name) == o.field_default, o.name
  assert options.check(cfg) == cfg  # every default passes its own check
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.io_threads = 3
  for o in options.OPTIONS:
    assert f"``{o.name}``" in ssd.StoreConfig.__doc__


def test_planner_defaults_are_the_tables():
  cfg = ssd.StoreConfig()
  assert cfg.staging_bytes is None  # "auto": the planner's arena is at most its floor
  assert planner.DEFAULT_STAGING_BYTES == options.staging.FLOOR_BYTES
  assert planner.DEFAULT_HOST_CACHE_BYTES == cfg.host_cache_bytes
  assert planner.DEFAULT_HOST_TIER_BYTES == cfg.host_tier_bytes
  p = planner.Profile(num_layers=1, forward_s=1, backward_s=1, tags=(), write_gbps=1, read_gbps=1)
  assert (p.staging_bytes, p.host_cache_bytes, p.host_tier_bytes) == (
    options.staging.FLOOR_BYTES,
    cfg.host_cache_bytes,
    cfg.host_tier_bytes,
  )


def test_docs_page_is_the_table():
  page = (ROOT / "docs" / "options.md").read_text()
  assert page.startswith("# Store options\n")
  assert options.render_docs(page) == page, (
    "docs/options.md differs from the option table: run "
    "`python -m jax_ssdtrain._src.options --write docs/options.md`"
  )
  table = page[page.index(options.DOCS_START) : page.index(options.DOCS_END)]
  for o in options.OPTIONS:
    assert f"| `{o.keywords[0]}`" in table and o.doc.replace("|", "\\|") in table, o.name
  assert options.main(["--check", str(ROOT / "docs" / "options.md")]) == 0


def test_docs_check_fails_on_a_stale_page(tmp_path, capsys):
  page = (ROOT / "docs" / "options.md").read_text()
  stale = tmp_path / "options.md"
  stale.write_text(page.replace("Threads reading and writing", "Threads writing"))
  assert options.main(["--check", str(stale)]) == 1
  assert "out of date" in capsys.readouterr().out
  assert options.main(["--write", str(stale)]) == 0
  assert stale.read_text() == page
  (tmp_path / "bare.md").write_text("# no markers\n")
  with pytest.raises(ValueError, match="options-table:start"):
    options.main(["--write", str(tmp_path / "bare.md")])


def test_every_variable_is_read(clean_env, tmp_path):
  with_env = [o.name for o in options.OPTIONS if o.env]
  assert sorted(ENV_SAMPLES) == sorted(with_env), "give each option with a variable a sample"
  for name, (text, want) in ENV_SAMPLES.items():
    option = options.BY_NAME[name]
    text = text.format(tmp=tmp_path)
    if isinstance(want, tuple):
      want = tuple(w.format(tmp=tmp_path) for w in want)
    assert want != option.field_default, name
    clean_env.setenv(option.env, text)
    assert getattr(ssd.default_config(), name) == want, (name, text)
    clean_env.setenv(option.env, "{nope}?")  # no option reads it (an unknown placeholder)
    with pytest.raises(ValueError, match=re.escape(option.env)):
      ssd.default_config()
    clean_env.delenv(option.env)
  assert ssd.default_config() == ssd.StoreConfig()


def _import_with(env: dict, code: str = "import jax_ssdtrain") -> subprocess.CompletedProcess:
  full = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
  full.update(JAX_PLATFORMS="cpu", **env)
  if "SSDTRAIN_LIB" in os.environ:
    full.setdefault("SSDTRAIN_LIB", os.environ["SSDTRAIN_LIB"])
  return subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT
  )


@pytest.mark.parametrize(
  "env,message",
  [
    ({"SSDTRAIN_HOST_TIER": "lots"}, "SSDTRAIN_HOST_TIER: cannot read 'lots' as a size; accepted:"),
    ({"SSDTRAIN_O_DIRECT": "maybe"}, "SSDTRAIN_O_DIRECT: expected on/off/auto, got 'maybe'"),
    ({"SSDTRAIN_DIR": "/x/{devices}"}, "SSDTRAIN_DIR: unknown placeholder {devices}"),
  ],
)
def test_a_bad_variable_fails_the_import_not_a_step(env, message):
  # It used to raise at the first step that offloaded, inside JAX's traceback of the tracing.
  proc = _import_with(env)
  assert proc.returncode == 1 and "ValueError: " + message in proc.stderr, proc.stderr
  assert "checks its SSDTRAIN_* environment variables when it is imported" in proc.stderr
  assert "jax/_src" not in proc.stderr and "Traceback" in proc.stderr


def test_an_unknown_variable_warns_naming_the_closest():
  proc = _import_with({"SSDTRAIN_HOST_TIER_BYTES": "1G", "SSDTRAIN_ZZZ": "1"})
  assert proc.returncode == 0, proc.stderr
  assert (
    "RuntimeWarning: jax_ssdtrain: the environment variable SSDTRAIN_HOST_TIER_BYTES is not an "
    "option of jax_ssdtrain and is ignored; did you mean SSDTRAIN_HOST_TIER?" in proc.stderr
  ), proc.stderr
  assert "SSDTRAIN_ZZZ is not an option" in proc.stderr and "SSDTRAIN_IO_THREADS" in proc.stderr
  # The other variables the code reads, and the options' own, say nothing.
  quiet = {name: "0" for name in options.OTHER_VARIABLES}
  quiet.update(SSDTRAIN_HOST_TIER="1MiB", SSDTRAIN_LIB=str(native.library_path()))
  assert options.check_environment(quiet) == []
  proc = _import_with(quiet)
  assert proc.returncode == 0 and "SSDTRAIN" not in proc.stderr, proc.stderr


def test_other_variables_are_those_the_code_reads():
  # OTHER_VARIABLES (no warning) lists exactly the SSDTRAIN_* variables read outside the table.
  reads = re.compile(
    r"""(?:getenv|environ\.get)\(\s*["'](SSDTRAIN_\w+)["']|ENV\{(SSDTRAIN_\w+)\}"""
    r"|foreach\(_opt ((?:SSDTRAIN_\w+ ?)+)\)"
  )
  found = {}
  for top in ("jax_ssdtrain", "xla_ffi", "scripts", "tests", "models", "benchmarks"):
    for path in (ROOT / top).rglob("*"):
      if (
        path.suffix in (".py", ".cc", ".h", ".cu", ".sh", ".cmake") or path.name == "CMakeLists.txt"
      ):
        for m in reads.finditer(path.read_text(errors="replace")):
          for name in " ".join(g for g in m.groups() if g).split():
            found.setdefault(name, str(path.relative_to(ROOT)))
  option_variables = {o.env for o in options.OPTIONS}
  assert set(found) - option_variables == set(options.OTHER_VARIABLES), found
  assert not option_variables & set(options.OTHER_VARIABLES)


def test_device_groups_follow_the_directory_variable(clean_env, tmp_path):
  n = len(jax.local_devices())
  clean_env.setenv("SSDTRAIN_DIR", f"{tmp_path}/x{{device}}")
  cfg = ssd.default_config()
  assert cfg.device_groups == n and len(cfg.directories) == n
  clean_env.setenv("SSDTRAIN_DIR", f"{tmp_path}/x")
  assert ssd.default_config().device_groups == 0


def test_configure_rejects_a_bad_value_of_each_option(tmp_path):
  assert sorted(BAD_VALUES) == sorted(OPTION_NAMES), "give each option a bad value"
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB) as before:
    for name, bad in BAD_VALUES.items():
      keyword = options.BY_NAME[name].keywords[0]
      with pytest.raises(ValueError) as e:
        ssd.configure(**{keyword: bad})
      message = str(e.value)
      assert message.startswith(f"{keyword}: "), message
      assert repr(bad) in message, message
      assert ssd.current_config() == before  # nothing was touched
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['io_thread'\]"):
      ssd.configure(io_thread=4)
    with pytest.raises(TypeError, match="directory and directories given together"):
      ssd.configure(directory=tmp_path / "a", directories=[tmp_path / "b"])
    assert ssd.current_config() == before


def test_configure_reads_sizes_and_rates_from_strings_only(tmp_path):
  with ssd.configured(
    tmp_path / "s", capacity_bytes="64MiB", chunk_bytes="1MiB", bandwidth_cap="1GB/s"
  ) as cfg:
    assert (cfg.capacity_bytes, cfg.chunk_bytes, cfg.bandwidth_cap) == (64 * MiB, MiB, 10**9)
    # Other options take typed values (text is the environment's form).
    for keyword, text in [("o_direct", "off"), ("io_threads", "2"), ("on_full", "Keep")]:
      with pytest.raises(ValueError, match=f"{keyword}: expected .*got '{text}'"):
        ssd.configure(**{keyword: text})


# ---------------------------------------------------------------------------------------------
# The engine: every key from the table, no defaults of its own


def test_every_option_reaches_the_engine(tmp_path, monkeypatch, clean_env):
  sent = []
  real = native.configure
  monkeypatch.setattr(native, "configure", lambda kv: (sent.append(dict(kv)), real(kv))[1])
  values = {name: value for name, (_, value) in ENV_SAMPLES.items()}
  values["directories"] = (str(tmp_path / "a"), str(tmp_path / "b"))
  values["device_groups"] = 2
  values["staging_bytes"] = 2 * MiB
  given = {options.BY_NAME[k].keywords[0]: v for k, v in values.items()}
  with ssd.configured(**given) as cfg:
    engine = native.engine_config()
  engine_names = [o.name for o in options.OPTIONS if o.engine]
  assert engine_names == list(sent[0]) == list(engine)
  assert engine_names == [o for o in OPTION_NAMES if o != "staging_max_bytes"]
  for o in options.OPTIONS:
    assert getattr(cfg, o.name) == values[o.name], o.name
    if o.engine:
      assert sent[0][o.name] == engine[o.name], o.name  # what the engine parsed is what was sent
  assert engine == {
    "directories": f"{tmp_path}/a:{tmp_path}/b",
    "capacity_bytes": str(300 * MiB),
    "host_cache_bytes": str(48 * MiB),
    "host_tier_bytes": "24000000",
    "staging_bytes": str(2 * MiB),
    "io_threads": "3",
    "chunk_bytes": str(128 << 10),
    "prefetch_bytes": str(2 * MiB),
    "o_direct": "0",
    "gds": "1",
    "forwarding": "0",
    "on_full": "1",
    "verify": "1",
    "exact_loads": "1",
    "bandwidth_cap": "7000000000",
    "device_groups": "2",
  }


def test_computed_defaults_reach_the_engine(tmp_path, clean_env):
  with ssd.configured(tmp_path / "s") as cfg:
    assert cfg.capacity_bytes is None  # computed when the store opens
    engine = native.engine_config()
  free = options.free_bytes_total([str(tmp_path)])
  assert abs(int(engine["capacity_bytes"]) - 0.9 * free) < 0.01 * free
  assert engine["directories"] == str(tmp_path / "s")
  cfg = ssd.StoreConfig()
  assert engine["host_tier_bytes"] == str(cfg.host_tier_bytes)
  assert cfg.staging_bytes is None  # auto: the floor until a program that stores runs
  assert engine["staging_bytes"] == str(options.staging.FLOOR_BYTES)


def test_engine_requires_every_key_and_refuses_unknown_ones(tmp_path):
  settings = options.engine_options(
    options.StoreConfig(capacity_bytes=64 * MiB), (str(tmp_path / "s"),)
  )
  assert list(settings) == [o.name for o in options.OPTIONS if o.engine]
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB):
    before = native.engine_config()
    for key in settings:
      partial = {k: v for k, v in settings.items() if k != key}
      with pytest.raises(ValueError, match=f"missing key '{key}'"):
        native.configure(partial)
    with pytest.raises(ValueError, match="unknown key 'staging_byte'.*known: directories, "):
      native.configure({**settings, "staging_byte": "1"})
    twice = options.engine_text(settings) + "io_threads=2\n"
    with pytest.raises(ValueError, match="key 'io_threads' given twice"):
      native._call_err(native.lib().ssdtrain_configure, twice.encode())
    with pytest.raises(ValueError, match="missing key 'directories'"):
      native.configure({})
    assert native.engine_config() == before  # a refused configuration leaves the store open


# ---------------------------------------------------------------------------------------------
# When the store opens: at a program's first run, never while it is lowered or compiled


def _assert_no_store(*directories):
  assert ssd.current_config() is None and native.engine_config() == {}
  assert native.stats()["configured"] == 0
  for d in directories:
    assert not os.path.exists(d), d


def test_lowering_and_compiling_open_no_store(tmp_path, clean_env, monkeypatch):
  config.reset_to_unconfigured()  # as in a fresh process
  store = tmp_path / "store"
  clean_env.setenv("SSDTRAIN_DIR", str(store))
  clean_env.setenv("SSDTRAIN_CAPACITY", "64MiB")
  w, x = _inputs()
  step = _offloading_step()
  try:
    lowered = step.lower(w, x)
    assert "ssdtrain_store" in lowered.as_text() and "ssdtrain_load" in lowered.as_text()
    _assert_no_store(store)
    compiled = lowered.compile()
    _assert_no_store(store)
    got = jax.block_until_ready(compiled(w, x))  # the first run opens it from the defaults
    assert ssd.current_config() == ssd.default_config()
    assert native.engine_config()["directories"] == str(store) and os.path.isdir(store)
    assert ssd.stats()["tensors_written"] == 1
    assert (jax.block_until_ready(step(w, x)) == got).all()  # jit's own executable: the same
  finally:
    config.reset_to_unconfigured()
  # Without a directory: no private temp dir either until a program runs.
  clean_env.delenv("SSDTRAIN_DIR")
  monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
  os.mkdir(tmp_path / "tmp")
  try:
    compiled = _offloading_step(2.0).lower(w, x).compile()
    _assert_no_store()
    assert os.listdir(tmp_path / "tmp") == []
    jax.block_until_ready(compiled(w, x))
    (private,) = os.listdir(tmp_path / "tmp")
    assert private.startswith(config.TEMP_PREFIX) and ssd.store_directories() == (
      str(tmp_path / "tmp" / private),
    )
  finally:
    config.reset_to_unconfigured()


def test_a_bad_configuration_raises_at_the_first_run_naming_the_cause(tmp_path, clean_env):
  config.reset_to_unconfigured()
  afile = tmp_path / "afile"
  afile.write_text("x")
  clean_env.setenv("SSDTRAIN_DIR", str(afile / "store"))
  clean_env.setenv("SSDTRAIN_CAPACITY", "64MiB")
  w, x = _inputs()
  step = _offloading_step()
  try:
    compiled = step.lower(w, x).compile()  # compiles: nothing is opened yet
    _assert_no_store()
    for run in (compiled, step, compiled):  # raised before dispatch, at every first run
      with pytest.raises(NotADirectoryError, match="is below .*afile"):
        run(w, x)
      _assert_no_store()
    clean_env.setenv("SSDTRAIN_DIR", str(tmp_path / "store"))
    got = jax.block_until_ready(compiled(w, x))  # the next run opens the store
    assert (got == jax.block_until_ready(step(w, x))).all()
    assert native.engine_config()["directories"] == str(tmp_path / "store")
  finally:
    config.reset_to_unconfigured()


def test_a_program_compiled_after_shutdown_raises_when_it_runs(tmp_path):
  ssd.configure(tmp_path / "s", capacity_bytes=64 * MiB)
  ssd.shutdown()
  w, x = _inputs()
  try:
    compiled = _offloading_step(4.0).lower(w, x).compile()  # lowering opens nothing
    assert native.engine_config() == {}
    with pytest.raises(ssd.StoreShutDownError, match=r"shut down.*jax_ssdtrain\.configure\("):
      compiled(w, x)
    assert native.engine_config() == {} and config.is_shut_down()
    ssd.configure(tmp_path / "t", capacity_bytes=64 * MiB)
    jax.block_until_ready(compiled(w, x))
    assert ssd.stats()["tensors_written"] == 1
  finally:
    config.reset_to_unconfigured()


# ---------------------------------------------------------------------------------------------
# After shutdown(): no store of its own


def test_a_step_compiled_before_shutdown_raises(tmp_path):
  step, (w, x) = _offloading_step(), _inputs()
  ssd.configure(tmp_path / "s", capacity_bytes=64 * MiB)
  try:
    want = jax.block_until_ready(step(w, x))
    ssd.shutdown()
    assert ssd.current_config() is None and native.engine_config() == {}
    with pytest.raises(Exception, match=r"store was shut down.*jax_ssdtrain\.configure\(") as e:
      jax.block_until_ready(step(w, x))
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
    assert native.engine_config() == {}  # no store opened by itself
    with pytest.raises(ssd.StoreShutDownError, match=r"shut down.*jax_ssdtrain\.configure\("):
      ssd.stats()
    with pytest.raises(ssd.StoreShutDownError, match="shut down"):
      ssd.store_directories()
    # Tracing a new program that offloads: the same error, before anything runs.
    with pytest.raises(ssd.StoreShutDownError, match="shut down"):
      _offloading_step(2.0)(w, x)
    ssd.flush()  # nothing to wait for: no error, no store
    assert native.engine_config() == {}
    # configure() opens it again; the old step runs on the new store.
    ssd.configure(tmp_path / "t", capacity_bytes=64 * MiB)
    assert (jax.block_until_ready(step(w, x)) == want).all()
    s = ssd.stats()
    assert s["configured"] == 1 and s["tensors_written"] == 1
    assert ssd.store_directories() == (str(tmp_path / "t"),)
  finally:
    config.reset_to_unconfigured()


def test_a_failed_step_does_not_fail_every_later_flush(tmp_path):
  # The outputs of a step that ran after shutdown() hold its error; while they are alive (here in
  # `failed`), flush() and collect() must still wait for the other arrays and not raise it again.
  step, (w, x) = _offloading_step(), _inputs()
  ssd.configure(tmp_path / "s", capacity_bytes=64 * MiB)
  try:
    want = jax.block_until_ready(step(w, x))
    ssd.shutdown()
    failed = step(w, x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="shut down"):
      jax.block_until_ready(failed)
    ssd.configure(tmp_path / "t", capacity_bytes=64 * MiB)
    got = step(w, x)
    ssd.flush()
    assert ssd.collect() == 0
    assert ssd.stats()["tensors_written"] == 1 and (got == want).all()
    del failed
  finally:
    config.reset_to_unconfigured()


def test_configured_block_restores_never_configured(tmp_path, clean_env):
  config.reset_to_unconfigured()
  w, x = _inputs()
  with ssd.configured(tmp_path / "s", capacity_bytes=64 * MiB):
    step = _offloading_step()
    jax.block_until_ready(step(w, x))
  assert ssd.current_config() is None and not config.is_shut_down()
  # A program compiled in the block finds no store: an error, not a store of its own.
  with pytest.raises(Exception, match="end of a jax_ssdtrain.configured"):
    jax.block_until_ready(step(w, x))
  # A new program opens the store from the defaults, as in a fresh process.
  clean_env.setenv("SSDTRAIN_DIR", str(tmp_path / "defaults"))
  clean_env.setenv("SSDTRAIN_CAPACITY", "64MiB")
  try:
    jax.block_until_ready(_offloading_step(3.0)(w, x))
    assert ssd.current_config() == ssd.default_config()
    assert ssd.stats()["configured"] == 1
    assert native.engine_config()["directories"] == str(tmp_path / "defaults")
  finally:
    config.reset_to_unconfigured()


def test_configured_block_after_shutdown_restores_shut_down(tmp_path):
  ssd.configure(tmp_path / "s", capacity_bytes=64 * MiB)
  ssd.shutdown()
  with ssd.configured(tmp_path / "t", capacity_bytes=64 * MiB):
    assert ssd.stats()["configured"] == 1
  assert config.is_shut_down()
  with pytest.raises(ssd.StoreShutDownError):
    ssd.stats()
  config.reset_to_unconfigured()


def test_native_store_needs_a_configured_store(tmp_path):
  import numpy as np

  ssd.configure(tmp_path / "s", capacity_bytes=64 * MiB)
  ssd.shutdown()
  src = np.zeros(4096, np.uint8)
  with pytest.raises(ValueError, match="store was shut down"):
    native.store_host(src.ctypes.data, src.nbytes, 1)
  config.reset_to_unconfigured()


# ---------------------------------------------------------------------------------------------
# The private store directory of a killed process

_PRIVATE_STORE = """
import sys, time, jax_ssdtrain as ssd
print(ssd.store_directories()[0], flush=True)
if sys.argv[1] == "wait":
  time.sleep(120)
"""


def test_a_killed_process_private_directory_is_removed_by_the_next(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
  env.update(JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), SSDTRAIN_CAPACITY="64MiB")
  if "SSDTRAIN_LIB" in os.environ:
    env["SSDTRAIN_LIB"] = os.environ["SSDTRAIN_LIB"]
  cmd = [sys.executable, "-c", _PRIVATE_STORE]
  killed = subprocess.Popen([*cmd, "wait"], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  try:
    first = killed.stdout.readline().strip()
    assert first.startswith(str(tmp_path / f"jax_ssdtrain-{killed.pid}-")), first
    assert config.remove_stale_temp_dirs(str(tmp_path)) == []  # its owner is alive
    assert os.path.isdir(first)
  finally:
    killed.send_signal(signal.SIGKILL)  # no atexit: the directory stays
    killed.wait()
  assert os.path.isdir(first)
  legacy = tmp_path / "jax_ssdtrain-abc123_x"  # a name of another scheme: not touched
  legacy.mkdir()
  proc = subprocess.run([*cmd, "exit"], capture_output=True, text=True, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  second = proc.stdout.strip()
  assert second != first and not os.path.exists(first), os.listdir(tmp_path)
  assert not os.path.exists(second)  # removed at exit
  assert os.listdir(tmp_path) == [legacy.name]


# ---------------------------------------------------------------------------------------------
# Sizes


@pytest.mark.parametrize(
  "text,want",
  [
    ("4G", 4 << 30),
    ("4g", 4 << 30),
    ("4GiB", 4 << 30),
    ("4Gi", 4 << 30),
    ("4GB", 4_000_000_000),
    ("1.5GB", 1_500_000_000),
    (" 512 MiB ", 512 << 20),
    ("512M", 512 << 20),
    ("1K", 1024),
    ("1KB", 1000),
    ("2T", 2 << 40),
    ("2TB", 2_000_000_000_000),
    ("7B", 7),
    ("1048576", 1 << 20),
    (1048576, 1 << 20),
    (1e9, 1_000_000_000),
    ("1e9", 1_000_000_000),
  ],
)
def test_parse_size(text, want):
  assert ssd.parse_size(text) == want


@pytest.mark.parametrize("bad", ["lots", "4Q", "4 GBs", "-1", "G", "4iB", "", "inf", True])
def test_parse_size_errors_list_the_accepted_forms(bad):
  with pytest.raises(ValueError) as e:
    ssd.parse_size(bad)
  message = str(e.value)
  assert message.startswith("size: ") and repr(bad) in message, message
  for unit in ("B", "K", "KiB", "KB", "M", "MiB", "MB", "G", "GiB", "GB", "T", "TiB", "TB"):
    assert re.search(rf"\b{unit}\b", message), (unit, message)
  assert "1024" in message and "1000" in message
  with pytest.raises(ValueError, match=r"^--size: cannot read 'lots'"):
    ssd.parse_size("lots", what="--size")
