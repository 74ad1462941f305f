"""Reliability and security: bad configuration, injected I/O faults, a full store,
integrity checks, privacy of the store files, concurrency, and a soak run.

Everything that could hang runs in a subprocess with a timeout. The subprocesses run on JAX's
CPU backend, or on the backend named by ``SSDTRAIN_TEST_PLATFORM`` (``cuda`` on a GPU machine:
through the CUDA handlers); the steps run in this process use JAX's default backend (the CUDA
handlers wherever JAX has a GPU).
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import _rel_common as rc
import jax
import pytest
from _limits import HANG_S

import jax_ssdtrain as ssd

HERE = os.path.dirname(os.path.abspath(__file__))
# Backend of the subprocesses: cpu here; `SSDTRAIN_TEST_PLATFORM=cuda` on a GPU machine runs
# them through the CUDA handlers.
PLATFORM = os.environ.get("SSDTRAIN_TEST_PLATFORM", "cpu")
MiB = 1 << 20


def run_py(code, *, env=None, timeout=HANG_S):
  """Runs `code` in a fresh interpreter (CPU jax); returns the CompletedProcess."""
  full_env = dict(
    os.environ,
    JAX_PLATFORMS=PLATFORM,
    XLA_PYTHON_CLIENT_PREALLOCATE="false",
    PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
  )
  full_env.pop("SSDTRAIN_FAULT", None)
  full_env.update(env or {})
  prelude = (
    "import os, sys, numpy as np, jax, jax.numpy as jnp\n"
    "import jax_ssdtrain as ssd\nfrom jax_ssdtrain._src import native\n"
    "import _rel_common as rc\n"
  )
  return subprocess.run(
    [sys.executable, "-c", prelude + textwrap.dedent(code)],
    env=full_env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def ok(p):
  assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
  return p


# ---------------------------------------------------------------------------------------------
# 1. Bad configuration


def test_directory_is_a_file(tmp_path):
  f = tmp_path / "afile"
  f.write_text("x")
  with pytest.raises(NotADirectoryError, match="afile.*not a directory"):
    ssd.configure(directory=f, capacity_bytes=16 * MiB)


def test_directory_below_a_file(tmp_path):
  f = tmp_path / "afile"
  f.write_text("x")
  with pytest.raises(NotADirectoryError, match="is below .*afile"):
    ssd.configure(directory=f / "sub" / "store", capacity_bytes=16 * MiB)


def test_directory_cannot_be_created():
  # /proc accepts no new directories, not even from root.
  with pytest.raises(OSError, match="/proc/ssdtrain-no-such/store"):
    ssd.configure(directory="/proc/ssdtrain-no-such/store", capacity_bytes=16 * MiB)


@pytest.mark.skipif(
  os.geteuid() == 0,
  reason="running as root: root can write to any "
  "directory, so a read-only directory cannot be tested",
)
def test_directory_not_writable(tmp_path):
  d = tmp_path / "ro"
  d.mkdir(mode=0o500)
  with pytest.raises(PermissionError, match="not writable"):
    ssd.configure(directory=d, capacity_bytes=16 * MiB)
  with pytest.raises(PermissionError, match="cannot be created"):
    ssd.configure(directory=d / "sub", capacity_bytes=16 * MiB)


@pytest.mark.parametrize("cap", [0, -1, "0"])
def test_capacity_not_positive(tmp_path, cap):
  with pytest.raises(ValueError, match=r"capacity_bytes.*(0|-1)"):
    ssd.configure(directory=tmp_path / "s", capacity_bytes=cap)


def test_capacity_beyond_free_space(tmp_path):
  import shutil

  free = shutil.disk_usage(tmp_path).free
  cap = free + (1 << 40)
  with pytest.raises(ValueError, match=rf"capacity_bytes={cap}.*beyond the free space"):
    ssd.configure(directory=tmp_path / "s", capacity_bytes=cap)


@pytest.mark.parametrize("key", ["host_tier_bytes", "host_cache_bytes"])
def test_host_memory_beyond_ram(tmp_path, key):
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  with pytest.raises(ValueError, match=rf"{key}={2 * ram}.*physical memory"):
    ssd.configure(directory=tmp_path / "s", capacity_bytes=16 * MiB, **{key: 2 * ram})


def test_unknown_option(tmp_path):
  with pytest.raises(ValueError, match="bogus_option"):
    ssd.configure(directory=tmp_path / "s", bogus_option=1)
  with pytest.raises(TypeError, match="bogus_option"):  # also a TypeError, as before
    ssd.configure(directory=tmp_path / "s", bogus_option=1)


@pytest.mark.parametrize(
  "key,value", [("on_full", "drop"), ("verify", "yes"), ("exact_loads", "no")]
)
def test_bad_new_option_values(tmp_path, key, value):
  with pytest.raises(ValueError, match=f"{key}.*{value}"):
    ssd.configure(directory=tmp_path / "s", capacity_bytes=16 * MiB, **{key: value})


def _shm_has_o_direct():
  import tempfile

  try:
    fd, path = tempfile.mkstemp(dir="/dev/shm")
  except OSError:
    return True
  os.close(fd)
  try:
    os.close(os.open(path, os.O_RDWR | os.O_DIRECT))
    return True
  except OSError:
    return False
  finally:
    os.unlink(path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm (tmpfs) here")
def test_no_o_direct_falls_back_with_warning():
  import tempfile

  if _shm_has_o_direct():
    pytest.skip(
      "this kernel's tmpfs supports O_DIRECT (Linux >= 6.6): no filesystem without "
      "O_DIRECT to test the fallback on"
    )
  d = tempfile.mkdtemp(prefix="ssdtrain-test-", dir="/dev/shm")
  try:
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported.*buffered"):
      with ssd.configured(directory=d, capacity_bytes=16 * MiB):
        assert ssd.stats()["o_direct"] == 0
        ours, ref = rc.steps()
        w, x = rc.params(1)
        rc.assert_equal(ours(w, x), ref(w, x))
    # Asking for O_DIRECT explicitly on tmpfs is an error naming the directory.
    with pytest.raises(OSError, match="O_DIRECT"):
      ssd.configure(directory=d, capacity_bytes=16 * MiB, o_direct=True)
  finally:
    ssd.shutdown()
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(
  "spec", ["write", "write:0:EIO", "frob:1:EIO", "read:1:EWHAT", "write:1:0"]
)
def test_bad_fault_spec(tmp_path, spec):
  p = run_py(
    f"""
      os.environ["SSDTRAIN_FAULT"] = {spec!r}
      try:
        ssd.configure(directory={str(tmp_path / "s")!r}, capacity_bytes=16 << 20)
      except ValueError as e:
        print("VALUEERROR", e)
      """,
    timeout=HANG_S,
  )
  ok(p)
  assert "VALUEERROR" in p.stdout and "SSDTRAIN_FAULT" in p.stdout, p.stdout


# ---------------------------------------------------------------------------------------------
# 2. Injected faults, truncated file; the process survives and trains on

FAULT_SCRIPT = """
    d = {d!r}
    ssd.configure(directory=d, capacity_bytes=64 << 20, forwarding=False, chunk_bytes=64 << 10,
                  host_cache_bytes=4 << 20, prefetch_bytes=0, io_threads=2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))
    h = jax.block_until_ready(rc.store(x, site=5, name="act_x"))
    err = None
    try:
      native.flush()
      {between}
      y = np.asarray(rc.load(h, x, site=5, name="act_x"))
      np.testing.assert_array_equal(y, np.asarray(x))
      print("LOADED_OK")
    except Exception as e:
      err = str(e)
      print("ERROR:", err)
    # Same process: a new store, and training goes on with correct gradients.
    os.environ.pop("SSDTRAIN_FAULT", None)
    ssd.configure(directory=d + "2", capacity_bytes=64 << 20, forwarding=False)
    ours, ref = rc.steps()
    for i in range(3):
      w, xx = rc.params(i)
      rc.assert_equal(ours(w, xx), ref(w, xx))
    ssd.flush()
    print("TRAINED_OK")
"""


@pytest.mark.parametrize(
  "spec,op,errname",
  [
    ("write:3:ENOSPC", "pwrite", "No space left on device"),
    ("write:1:EIO", "pwrite", "Input/output error"),
    ("read:1:EIO", "pread", "Input/output error"),
    ("read:2:EROFS", "pread", "Read-only file system"),
  ],
)
def test_injected_io_error(tmp_path, spec, op, errname):
  p = ok(
    run_py(FAULT_SCRIPT.format(d=str(tmp_path / "s"), between="pass"), env={"SSDTRAIN_FAULT": spec})
  )
  assert "ERROR:" in p.stdout and "LOADED_OK" not in p.stdout, p.stdout
  msg = p.stdout.split("ERROR:", 1)[1]
  assert op in msg and errname in msg and "tag 'act_x'" in msg, msg
  assert "errno" in msg
  assert "TRAINED_OK" in p.stdout


@pytest.mark.parametrize(
  "spec", ["shortwrite:2:0", "shortwrite:1:0", "shortread:1:0", "shortread:3:0"]
)
def test_short_transfers_are_retried(tmp_path, spec):
  p = ok(
    run_py(FAULT_SCRIPT.format(d=str(tmp_path / "s"), between="pass"), env={"SSDTRAIN_FAULT": spec})
  )
  assert "LOADED_OK" in p.stdout and "TRAINED_OK" in p.stdout, p.stdout + p.stderr


def test_truncated_store_file(tmp_path):
  p = ok(run_py(FAULT_SCRIPT.format(d=str(tmp_path / "s"), between="native.debug_truncate(0)")))
  msg = p.stdout.split("ERROR:", 1)[1]
  assert "pread" in msg and "truncated" in msg and "tag 'act_x'" in msg and "errno 5" in msg, msg
  assert "TRAINED_OK" in p.stdout


def test_write_fault_inside_a_training_step(tmp_path):
  p = ok(
    run_py(f"""
      os.environ["SSDTRAIN_FAULT"] = "write:2:EIO"
      ssd.configure(directory={str(tmp_path / "s")!r}, capacity_bytes=64 << 20, forwarding=False)
      ours, ref = rc.steps()
      w, x = rc.params(0)
      try:
        jax.block_until_ready(ours(w, x))
        ssd.flush()
        print("NO ERROR")
      except Exception as e:
        print("ERROR:", e)
      os.environ.pop("SSDTRAIN_FAULT")
      ssd.configure(directory={str(tmp_path / "s2")!r}, capacity_bytes=64 << 20,
                    forwarding=False)
      for i in range(3):
        w, x = rc.params(i)
        rc.assert_equal(ours(w, x), ref(w, x))
      print("TRAINED_OK")
      """)
  )
  assert "ERROR:" in p.stdout and "Input/output error" in p.stdout, p.stdout
  assert "tag 'h'" in p.stdout or "tag 'g'" in p.stdout
  assert "TRAINED_OK" in p.stdout


# ---------------------------------------------------------------------------------------------
# 3. Store full


def test_on_full_error(tmp_path):
  with ssd.configured(directory=tmp_path / "s", capacity_bytes=32 << 10, on_full="error"):
    ours, _ = rc.steps()
    w, x = rc.params(0)  # 6 tensors of 16 KiB
    with pytest.raises(Exception, match="capacity_bytes=32768"):
      jax.block_until_ready(ours(w, x))


def test_on_full_keep(tmp_path):
  with ssd.configured(
    directory=tmp_path / "s", capacity_bytes=32 << 10, on_full="keep", forwarding=False
  ):
    ours, ref = rc.steps()
    for i in range(3):
      w, x = rc.params(i)
      rc.assert_equal(ours(w, x), ref(w, x))
    with pytest.warns(RuntimeWarning, match="on_full='keep' kept"):
      ssd.flush()
    s = ssd.stats()
    assert s["full_kept_tensors"] >= 3 * 4 and s["full_kept_bytes"] >= 3 * 4 * (16 << 10)
    assert s["file_bytes_peak"] <= 32 << 10  # never more than the capacity in the file
    assert s["disk_tensors_written"] >= 3 * 2
    import warnings

    with warnings.catch_warnings():
      warnings.simplefilter("error")  # once per configuration
      ssd.flush()


def test_on_full_keep_host_tier_also_full(tmp_path):
  with ssd.configured(
    directory=tmp_path / "s", capacity_bytes=32 << 10, on_full="keep", host_tier_bytes=16 << 10
  ):
    ours, _ = rc.steps()
    w, x = rc.params(0)
    with pytest.raises(Exception, match="host tier has no room"):
      jax.block_until_ready(ours(w, x))


# ---------------------------------------------------------------------------------------------
# 4. Integrity


@pytest.mark.parametrize("cache", [4 << 20, 64 << 10], ids=["cached_read", "bounce_read"])
def test_verify_detects_flipped_byte(tmp_path, cache):
  p = ok(
    run_py(
      FAULT_SCRIPT.replace("forwarding=False,", "forwarding=False, verify=True,")
      .replace("host_cache_bytes=4 << 20", f"host_cache_bytes={cache}")
      .format(d=str(tmp_path / "s"), between="native.debug_corrupt(1000)")
    )
  )
  msg = p.stdout.split("ERROR:", 1)[1]
  assert "checksum mismatch" in msg and "tag 'act_x'" in msg, msg
  assert "TRAINED_OK" in p.stdout


def test_without_verify_a_flipped_byte_goes_unnoticed(tmp_path):
  p = ok(run_py(FAULT_SCRIPT.format(d=str(tmp_path / "s"), between="native.debug_corrupt(1000)")))
  assert "ERROR:" in p.stdout and "not equal" in p.stdout.split("ERROR:", 1)[1]


@pytest.mark.parametrize("forwarding", [True, False])
def test_verify_grads_and_counters(tmp_path, forwarding):
  with ssd.configured(
    directory=tmp_path / "s",
    capacity_bytes=64 << 20,
    verify=True,
    forwarding=forwarding,
    host_cache_bytes=64 << 10,
  ):
    assert ssd.stats()["verify"] == 1
    ours, ref = rc.steps()
    for i in range(3):
      w, x = rc.params(i)
      rc.assert_equal(ours(w, x), ref(w, x))
    ssd.flush()
    s = ssd.stats()
    assert s["checksum_failures"] == 0
    if not forwarding:
      assert s["disk_tensors_read"] >= 6


def test_crc32c_known_answer(tmp_path):
  # The standard check value of crc32c("123456789") is 0xE3069283: store those bytes,
  # corrupt nothing, and compare the engine's crc through a mismatch message instead.
  p = ok(
    run_py(
      f"""
      ssd.configure(directory={str(tmp_path / "s")!r}, capacity_bytes=16 << 20, verify=True,
                    forwarding=False, prefetch_bytes=0)
      x = jnp.asarray(np.frombuffer(b"123456789", np.uint8))
      h = jax.block_until_ready(rc.store(x, site=3, name="kat"))
      native.flush()
      native.debug_corrupt(0)  # '1' ^ 0x5A
      try:
        rc.load(h, x, site=3, name="kat").block_until_ready()
      except Exception as e:
        print("ERROR:", e)
      """,
      env={"SSDTRAIN_CRC_SOFTWARE": "1"},
    )
  )
  assert "0xe3069283 written" in p.stdout, p.stdout
  import zlib  # noqa: F401  (zlib has crc32, not crc32c: the value above is the reference)


# ---------------------------------------------------------------------------------------------
# 5. Privacy


def test_kill_9_leaves_nothing_readable(tmp_path):
  d = tmp_path / "store"
  proc = subprocess.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(f"""
          import jax, jax_ssdtrain as ssd, _rel_common as rc
          ssd.configure(directory={str(d)!r}, capacity_bytes=256 << 20, forwarding=False)
          ours, _ = rc.steps()
          w, x = rc.params(0, d=256, batch=256)
          for i in range(1000000):
            g = ours(w, x)
            if i == 3:
              jax.block_until_ready(g)
              print("READY", flush=True)
          """),
    ],
    env=dict(
      os.environ, JAX_PLATFORMS=PLATFORM, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=HERE
    ),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    t0 = time.monotonic()
    line = ""
    while "READY" not in line:
      line = proc.stdout.readline()
      assert line or proc.poll() is None, proc.stderr.read()
      assert time.monotonic() - t0 < HANG_S
    assert os.listdir(d) == []  # already while it runs: the files are unlinked
    time.sleep(0.2)  # mid-step
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert os.listdir(d) == []
  assert (os.stat(d).st_mode & 0o777) == 0o700


def test_tag_names_never_become_paths(tmp_path, monkeypatch):
  cwd = tmp_path / "a" / "b"
  cwd.mkdir(parents=True)
  monkeypatch.chdir(cwd)
  names = ("../../etc/x", "/tmp/../x\\0y")
  d = tmp_path / "a" / "b" / "store"
  with ssd.configured(directory=d, capacity_bytes=64 << 20, forwarding=False):
    ours, ref = rc.steps(names)
    w, x = rc.params(0)
    rc.assert_equal(ours(w, x), ref(w, x))
    ssd.flush()
    assert ssd.stats()["disk_tensors_written"] == 6
    assert os.listdir(d) == []
  found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  assert found == ["a", "a/b", "a/b/store"], found
  assert not os.path.exists("/etc/x") or os.path.getmtime("/etc/x") < time.time() - 3600


# ---------------------------------------------------------------------------------------------
# 6. Concurrency


def test_two_processes_one_directory(tmp_path):
  d = str(tmp_path / "shared")
  code = textwrap.dedent(f"""
      import jax, jax_ssdtrain as ssd, _rel_common as rc
      ssd.configure(directory={d!r}, capacity_bytes=256 << 20, forwarding=False,
                    host_cache_bytes=1 << 20)
      ours, ref = rc.steps()
      for i in range(30):
        w, x = rc.params(i, d=128, batch=128)
        rc.assert_close(ours(w, x), ref(w, x))
      ssd.flush()
      s = ssd.stats()
      assert s["disk_tensors_read"] > 0, s
      print("OK", s["disk_tensors_written"])
      """)
  env = dict(
    os.environ, JAX_PLATFORMS=PLATFORM, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=HERE
  )
  env.pop("SSDTRAIN_FAULT", None)
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", code],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(2)
  ]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=HANG_S)
      outs.append((p.returncode, out, err[-3000:]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for rcode, out, err in outs:
    assert rcode == 0 and "OK" in out, (out, err)
  assert os.listdir(d) == []


@pytest.mark.parametrize("same_fn", [True, False], ids=["same_jit", "two_jits"])
def test_two_threads_jitted_steps(tmp_path, same_fn):
  with ssd.configured(
    directory=tmp_path / "s", capacity_bytes=256 << 20, forwarding=False, host_cache_bytes=1 << 20
  ):
    ours1, ref = rc.steps()
    ours2 = ours1 if same_fn else rc.steps(("p", "q"))[0]
    inputs = {s: rc.params(s, d=128, batch=128) for s in [*range(15), *range(100, 115)]}
    # Expected: the same executables run one at a time (bit-exact on any backend), and the
    # device-saving policy (bit-exact on CPU; the GPU may fuse it differently).
    serial = {s: (ours1 if s < 100 else ours2)(*inputs[s]) for s in inputs}
    for s in inputs:
      rc.assert_close(serial[s], ref(*inputs[s]))
    errors = []

    def worker(fn, seed0):
      try:
        for i in range(15):
          rc.assert_equal(fn(*inputs[seed0 + i]), serial[seed0 + i])
      except BaseException as e:  # noqa: BLE001
        errors.append(e)

    ts = [
      threading.Thread(target=worker, args=(ours1, 0)),
      threading.Thread(target=worker, args=(ours2, 100)),
    ]
    for t in ts:
      t.start()
    for t in ts:
      t.join(timeout=HANG_S)
    assert not any(t.is_alive() for t in ts), "threads hung"
    assert not errors, errors
    ssd.flush()


# ---------------------------------------------------------------------------------------------
# 7. Soak


def test_soak_1000_steps_flat(tmp_path):
  d = str(tmp_path / "soak")
  p = ok(
    run_py(
      f"""
      import resource
      def rss():
        with open("/proc/self/statm") as f:
          return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
      ssd.configure(directory={d!r}, capacity_bytes=64 << 20, forwarding=False,
                    host_cache_bytes=256 << 10, prefetch_bytes=64 << 10)
      ours, ref = rc.steps()
      w, x = rc.params(0, n_layers=2, d=32, batch=16)
      want = ref(w, x)
      marks = {{}}
      for i in range(1000):
        g = ours(w, x)
        if i % 100 == 0 or i == 999:
          rc.assert_equal(g, want)
          ssd.flush()
          s = ssd.stats()
          marks[i] = (s["file_bytes_in_use"], s["live_entries"], len(os.listdir("/proc/self/fd")),
                      rss(), s["host_cache_bytes_in_use"])
      for i, m in sorted(marks.items()):
        print(i, m)
      warm = marks[100]
      for i, (fb, live, fds, r, cache) in marks.items():
        if i < 100:
          continue
        assert fb == warm[0] and live == warm[1], (i, marks[i], warm)
        assert fds <= warm[2] + 2, (i, fds, warm)
        assert cache <= 256 << 10
        assert r <= warm[3] + (48 << 20), ("RSS grew", i, r, warm[3])
      assert ssd.stats()["disk_tensors_read"] > 0
      assert len(rc.store_fds({d!r})) == 1
      ssd.shutdown()
      assert rc.store_fds({d!r}) == [], rc.store_fds({d!r})
      assert os.listdir({d!r}) == []
      print("SOAK_OK")
      """,
      timeout=HANG_S,
    )
  )
  assert "SOAK_OK" in p.stdout
