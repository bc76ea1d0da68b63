"""The program cache: a second start with the same configuration compiles nothing and gives the
same tokens; a changed key input misses; a damaged entry is rejected with a log line and rebuilt."""
import logging
import time

import jax
import pytest
from jax import monitoring

from tests.hf_models import build_llama
from jaxserve import LLM
from jaxserve.executor.program_cache import MAGIC, ProgramCache, program_key, runtime_parts
from jaxserve.executor.programs import ProgramSet

# 9 programs: decode 1/2 rows, prefill 1 row x 16 tokens, updates 8/16, samplers 1x1 and 2x2 (greedy, sampling).
CONFIG = dict(num_pages=16, page_size=8, max_num_seqs=2, max_prefill_seqs=1, prefill_chunk=16,
              max_num_batched_tokens=16, max_model_len=64, strict_compiles=True)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4]]


class XlaCompiles:
    """Counts XLA compilations in the process while active (jax's monitoring events): every
    backend compile, minus those served from jax's own persistent cache."""

    def __init__(self):
        self.compiles = self.cache_hits = 0
        self.active = False
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event, seconds, **kw):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1

    def _event(self, event, **kw):
        if self.active and event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def __enter__(self):
        self.compiles = self.cache_hits = 0
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False

    @property
    def real(self) -> int:
        return self.compiles - self.cache_hits


@pytest.fixture(scope="module", autouse=True)
def without_jax_cache():
    """jax's own caches off and empty here (tests turn the persistent one on): a program jax loads
    from it, or hands back from memory after an earlier test compiled it, is served but not stored
    (``jaxserve.programs``), which would leave these tests nothing to load."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("program_cache_llama")
    build_llama(path, seed=11)
    return str(path)


@pytest.fixture(scope="module")
def first(model, tmp_path_factory):
    cache = tmp_path_factory.mktemp("programs")
    llm = LLM(model, kv_format="bf16", program_cache=str(cache), **CONFIG)
    llm.warmup()
    return llm, cache, [list(c) for c in llm.generate(PROMPTS, max_tokens=6, ignore_eos=True)]


def test_second_start_compiles_nothing_and_gives_the_same_tokens(model, first):
    llm1, cache, tokens = first
    p1 = llm1.engine.programs
    assert p1.loaded == 0 and p1.compiled == len(p1.names()) == 9
    llm = LLM(model, kv_format="bf16", program_cache=str(cache), **CONFIG)
    with XlaCompiles() as xla:
        llm.warmup()
    p = llm.engine.programs
    assert (p.compiled, p.loaded) == (0, 9)
    snap = llm.engine.snapshot()
    assert (snap.programs_compiled, snap.programs_loaded) == (0, 9)
    assert xla.compiles == 0, "warm-up compiled with XLA although every program was cached"
    assert [list(c) for c in llm.generate(PROMPTS, max_tokens=6, ignore_eos=True)] == tokens
    assert llm.runner.compiles_after_warmup == 0


def test_a_changed_key_input_misses(first):
    llm, cache, _ = first
    spec = llm.runner.program_specs([1], [])[0]  # decode/1x1
    same = ProgramSet(ProgramCache(cache), llm.runner.key_parts())
    other_jax = ProgramSet(ProgramCache(cache), llm.runner.key_parts(), runtime={**runtime_parts(), "jax": "0.0.1"})
    other_kv = ProgramSet(ProgramCache(cache), {**llm.runner.key_parts(), "kv_format": "fp8_e4m3"})
    keys = {s.key(spec)[0] for s in (same, other_jax, other_kv)}
    assert len(keys) == 3
    same.build([spec])
    jax.clear_caches()  # as in another process: compiled afresh, not handed back from memory
    other_jax.build([spec])
    assert (same.loaded, same.compiled) == (1, 0)
    assert (other_jax.loaded, other_jax.compiled, other_jax.cache.misses) == (0, 1, 1)
    assert other_jax.cache.path(other_jax.key(spec)[0]).exists()  # stored under its own key


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_a_damaged_entry_is_rejected_logged_and_rebuilt(first, damage, caplog):
    llm, cache, _ = first
    spec = llm.runner.program_specs([2], [])[0]  # decode/2x1
    programs = ProgramSet(ProgramCache(cache), llm.runner.key_parts())
    key = programs.key(spec)[0]
    path = programs.cache.path(key)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    else:  # a valid entry of another program under this one's name
        other = programs.key(llm.runner.program_specs([1], [])[0])[0]
        path.write_bytes(programs.cache.path(other).read_bytes())
    with caplog.at_level(logging.WARNING, logger="jaxserve.program_cache"):
        programs.build([spec])
    assert (programs.cache.rejected, programs.loaded, programs.compiled) == (1, 0, 1)
    assert any(str(path) in r.getMessage() and "rejected" in r.getMessage() for r in caplog.records)
    again = ProgramSet(ProgramCache(cache), llm.runner.key_parts())
    again.build([spec])
    assert (again.loaded, again.cache.rejected) == (1, 0)  # the rebuilt entry is whole


def test_cache_entries_round_trip_and_reject_without_jax(tmp_path, caplog):
    cache = ProgramCache(tmp_path)
    key = program_key({"a": 1})
    assert key != program_key({"a": 2}) and key == program_key({"a": 1})
    assert cache.load(key) is None and cache.misses == 1
    path = cache.store(key, b"payload bytes")
    assert path.read_bytes().startswith(MAGIC)
    assert cache.load(key) == b"payload bytes" and cache.hits == 1
    path.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="jaxserve.program_cache"):
        assert cache.load(key) is None
    assert cache.rejected == 1 and not path.exists()
    assert "bad magic" in caplog.text


def test_serving_while_warming_runs_in_built_buckets_only(model, first):
    """on_serviceable is called once the largest buckets are built; a batch then runs padded
    into them (the guard is on: a compilation would raise) with the same greedy tokens."""
    _, _, tokens = first
    llm = LLM(model, kv_format="bf16", **CONFIG)  # no disk cache: everything compiles here
    seen, batches = {}, []
    llm.engine.add_step_observer(lambda rec: batches.append((rec.phase, rec.rows, rec.batch)))

    def serve_now():
        seen["ready"] = sorted(llm.engine.programs.names())
        seen["tokens"] = [list(c) for c in llm.generate(PROMPTS[:1], max_tokens=6, ignore_eos=True)]

    progress = []
    llm.engine.warmup(progress=lambda done, total: progress.append((done, total)), on_serviceable=serve_now)
    assert "decode/1x1" not in seen["ready"] and "decode/2x1" in seen["ready"]
    assert seen["tokens"] == tokens[:1]
    assert ("decode", 1, 2) in batches  # one request decoded in the 2-row bucket
    assert llm.runner.compiles_after_warmup == 0
    assert progress[-1] == (9, 9) and len(llm.engine.programs.names()) == 9
    assert [d for d, _ in progress] == sorted(d for d, _ in progress)


def test_server_reports_warmup_progress(model, first):
    import urllib.request

    from jaxserve.client import Client
    from jaxserve.server.app import ServerThread

    _, cache, tokens = first
    llm = LLM(model, kv_format="bf16", program_cache=str(cache), **CONFIG)
    with ServerThread(llm, serve_while_warming=True) as st:
        st.wait_ready(120)
        deadline = time.monotonic() + 60
        while st.server.service.generations.warmup_progress != (9, 9) and time.monotonic() < deadline:
            time.sleep(0.05)  # the last programs may still be loading: SERVING came first
        text = urllib.request.urlopen(f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
        assert "jaxserve_warmup_programs_total 9.0" in text
        assert "jaxserve_programs_loaded 9.0" in text and "jaxserve_programs_compiled 0.0" in text
        assert st.server.service.generations.warmup_progress[1] == 9
        client = Client(st.target, timeout=60)
        assert list(client.generate(PROMPTS[0], max_tokens=6, ignore_eos=True).token_ids) == tokens[0]
        client.close()


def test_nothing_is_stored_while_jax_persistent_cache_is_on(model, tmp_path, caplog):
    """With jax's own persistent cache on, an executable may come from it (or from memory, after
    it did) and would not load whole: the program cache stores nothing and says why; the
    programs still serve."""
    cache, before = tmp_path / "programs", jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxserve.programs"):
            llm = LLM(model, kv_format="bf16", program_cache=str(cache), **CONFIG)
            llm.warmup()
    finally:
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_compilation_cache_dir", before)
    assert llm.engine.programs.compiled == 9 and not list(cache.glob("*.program"))
    assert sum("persistent compilation cache is on" in r.message for r in caplog.records) == 1
    assert len(llm.generate(PROMPTS, max_tokens=3, ignore_eos=True)) == 2


@pytest.mark.parametrize("arenas, load_workers", [(None, 2), ("4", 2), ("1", 1)])
def test_loads_in_parallel_unless_malloc_has_one_arena(monkeypatch, arenas, load_workers):
    """Cache hits load two at a time, except under MALLOC_ARENA_MAX=1, where one malloc lock
    makes parallel loads slower than serial ones; compiles keep their workers."""
    if arenas is None:
        monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    else:
        monkeypatch.setenv("MALLOC_ARENA_MAX", arenas)
    p = ProgramSet(None, {}, workers=2)
    assert (p.load_workers, p.workers) == (load_workers, 2)


def test_startup_profile_reports_every_program(first):
    from jaxserve.startup_profile import StartupProfile

    llm, _, _ = first
    profile = StartupProfile()
    profile.add("weights", 1.25)
    text = profile.report(llm.engine.programs)
    assert "weights" in text and "1.25" in text
    assert "9 (0 from the program cache, 9 compiled" in text and "at a time" in text
    for name in llm.engine.programs.names():  # one row per program, with its source
        assert any(line.split()[:2] == [name, "compiled"] for line in text.splitlines()), name


def test_batch_invariant_and_role_name_other_programs(model, first):
    """A batch-invariant engine (its own row tiles, per-row samplers) and a prefill or decode
    worker (a prefill worker has no decode program) never load the default engine's programs
    from the same cache; the batch-invariant ones then load on its own second start."""
    _, cache, _ = first
    llm = LLM(model, kv_format="bf16", program_cache=str(cache), batch_invariant=True, **CONFIG)
    llm.warmup()
    p = llm.engine.programs
    assert (p.loaded, p.compiled) == (0, 9)
    samplers = [n for n in p.names() if n.startswith("sample/")]
    assert len(samplers) == 4 and all(n.endswith("/per_row") for n in samplers)
    again = LLM(model, kv_format="bf16", program_cache=str(cache), batch_invariant=True, **CONFIG)
    again.warmup()
    assert (again.engine.programs.loaded, again.engine.programs.compiled) == (9, 0)
    assert [list(c) for c in again.generate(PROMPTS, max_tokens=6, ignore_eos=True)] == \
        [list(c) for c in llm.generate(PROMPTS, max_tokens=6, ignore_eos=True)]
    assert again.runner.compiles_after_warmup == 0
    prefill = LLM(model, kv_format="bf16", program_cache=str(cache), role="prefill", **CONFIG)
    prefill.warmup()
    names = prefill.engine.programs.names()
    assert "prefill/1x16" in names and not any(n.startswith("decode/") for n in names)
    assert prefill.engine.programs.loaded == 0
    decode = LLM(model, kv_format="bf16", program_cache=str(cache), role="decode", **CONFIG)
    decode.warmup()  # the same weights and buckets as the default engine's: only the role differs
    assert (decode.engine.programs.loaded, decode.engine.programs.compiled) == (0, 9)


def test_unavailable_message_carries_warmup_progress():
    """Both fronts raise Generations.check_serving's error while warming up (HTTP: its 503)."""
    from jaxserve.server.errors import ServeError
    from jaxserve.server.generations import Generations

    gens = Generations(None, None, max_waiting=1, max_num_seqs=1)
    with pytest.raises(ServeError, match=r"warming up;"):
        gens.check_serving()  # no progress yet
    gens.warmup_progress = (3, 9)
    with pytest.raises(ServeError, match=r"warming up \(3/9 programs ready\)"):
        gens.check_serving()
    gens.phase = "draining"
    with pytest.raises(ServeError, match=r"is draining;"):
        gens.check_serving()
    gens.phase = "serving"
    gens.check_serving()
