"""The capacity bench's traces and its ceiling: what is asked, and the best any pool could do.

Three families of token-id prompts (seeded, no tokenizer), replayed one request at a
time by `kvdepot bench --capacity` (kvdepot.bench.capacity):

- **chat**: multi-turn conversations over a shared system prompt; each turn's prompt
  is the last one plus the answer and a new message; conversations are picked
  Zipf-popular (s = 1) and end after `CHAT_TURNS` turns (a new one takes the slot).
- **docs**: shared documents asked about by many users: a shared system prompt, a
  document picked Zipf-popular, a question of the user's own (never asked again).
- **agent**: agent loops re-reading a growing context: each step's prompt is the
  agent's whole context plus a new observation; agents run side by side (the next
  step is any live agent's, uniformly) and end after `AGENT_STEPS` steps.

Chunk identity is the token prefix (`chunk_ids`), as vLLM's chained block hashes make
it: two prompts share a chunk only if they share every token up to its end. A trace's
*working set* is its reusable footprint: the distinct chunks at least two requests
reach (a question asked once is not in it). `make_trace` picks the family's session
count (conversations, documents, agents) whose working set is nearest `ratio` x the pool.

`belady` is the ceiling: with the whole trace known, at chunk granularity, each request
hits its leading chunks held (a hit after a miss is no hit), then the pool keeps, of
what it held and the request's chunks, those whose next use comes soonest (a chunk
never used again is not kept; ties keep a prefix's head). This is Belady's MIN with
bypass, run per request.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

CHUNK_TOKENS = 16  # one block of 16 tokens per chunk (the bench's geometry)
VOCAB = 30000
ZIPF_S = 1.0
SYSTEM_TOKENS = CHUNK_TOKENS
CHAT_TURNS = 5
AGENT_STEPS = 8
FAMILIES = ("chat", "docs", "agent")


@dataclass
class Trace:
    family: str
    sessions: int  # conversations, documents or agents
    prompts: list[list[int]]
    ratio: float = 0.0  # the working set asked for, in pools
    pool_chunks: int = 0
    working_set: float = 0.0  # chunks in play, on average over the requests (_measure)
    footprint: int = 0  # distinct chunks of every prompt
    prompt_tokens: int = 0
    chunk_lists: list[list[int]] = field(default_factory=list)  # chunk ids per request

    def summary(self) -> dict[str, object]:
        return {
            "family": self.family,
            "ratio": self.ratio,
            "sessions": self.sessions,
            "requests": len(self.prompts),
            "working_set_chunks": self.working_set,
            "working_set_over_pool": self.working_set / self.pool_chunks,
            "footprint_chunks": self.footprint,
            "prompt_tokens": self.prompt_tokens,
            "longest_prompt_chunks": max(len(c) for c in self.chunk_lists),
        }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [10 + rng.randrange(VOCAB) for _ in range(n)]


def _zipf_picker(rng: random.Random, n: int) -> Callable[[], int]:
    """Draws 0..n-1 with weight 1/rank^s, the popular ones spread over the range."""
    order = list(range(n))
    rng.shuffle(order)
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** ZIPF_S for rank in range(n)))
    total = cumulative[-1]
    return lambda: order[min(n - 1, bisect.bisect(cumulative, rng.random() * total))]


# A request of a trace: (session, prompt, tokens of it that stay in play: the
# conversation's or agent's context, the document without the question). A generator
# first names every session with its context before the trace (prompt empty: not a
# request), then the requests.
Asked = tuple[int, list[int], int]


def chat_prompts(sessions: int, requests: int, seed: int) -> list[Asked]:
    rng = random.Random(seed)
    system = _tokens(random.Random(seed * 31 + 1), SYSTEM_TOKENS)

    def turn(context: list[int]) -> None:
        if len(context) > len(system):  # the last answer, then the new message
            context += _tokens(rng, rng.randint(8, 24))
        context += _tokens(rng, rng.randint(8, 24))

    # The trace starts mid-day: each conversation is some turns in already.
    history, turns = [], []
    for _ in range(sessions):
        context, done = list(system), rng.randrange(CHAT_TURNS)
        for _ in range(done):
            turn(context)
        history.append(context)
        turns.append(done)
    pick = _zipf_picker(rng, sessions)
    out: list[Asked] = [(s, [], len(history[s])) for s in range(sessions)]
    for _ in range(requests):
        s = pick()
        if turns[s] >= CHAT_TURNS:  # the conversation ended: a new one in its slot
            history[s], turns[s] = list(system), 0
        turn(history[s])
        turns[s] += 1
        out.append((s, list(history[s]), len(history[s])))
    return out


def docs_prompts(sessions: int, requests: int, seed: int) -> list[Asked]:
    rng = random.Random(seed)
    system = _tokens(random.Random(seed * 31 + 2), SYSTEM_TOKENS)
    docs = [system + _tokens(rng, rng.randint(2, 6) * CHUNK_TOKENS) for _ in range(sessions)]
    pick = _zipf_picker(rng, sessions)
    out: list[Asked] = [(d, [], len(docs[d])) for d in range(sessions)]
    for _ in range(requests):
        d = pick()
        out.append((d, docs[d] + _tokens(rng, rng.randint(8, 40)), len(docs[d])))
    return out


def agent_prompts(sessions: int, requests: int, seed: int) -> list[Asked]:
    rng = random.Random(seed)
    tools = _tokens(random.Random(seed * 31 + 3), SYSTEM_TOKENS)

    def start() -> list[int]:  # a new agent: the tools, then its task
        return tools + _tokens(rng, rng.randint(8, 24))

    def step(context: list[int]) -> None:  # the last step's observation
        context += _tokens(rng, rng.randint(12, 36))

    # The trace starts mid-day: each agent is some steps in already.
    contexts, steps = [], []
    for _ in range(sessions):
        context, done = start(), rng.randrange(AGENT_STEPS)
        for _ in range(done):
            step(context)
        contexts.append(context)
        steps.append(done)
    out: list[Asked] = [(a, [], len(contexts[a])) for a in range(sessions)]
    for _ in range(requests):
        a = rng.randrange(sessions)
        if steps[a] >= AGENT_STEPS:  # the agent ended: a new one in its slot
            contexts[a], steps[a] = start(), 0
        step(contexts[a])
        steps[a] += 1
        out.append((a, list(contexts[a]), len(contexts[a])))
    return out


GENERATORS: dict[str, Callable[[int, int, int], list[Asked]]] = {
    "chat": chat_prompts,
    "docs": docs_prompts,
    "agent": agent_prompts,
}


def chunk_ids(prompt: Sequence[int]) -> list[int]:
    """One id per full chunk of `prompt`, chained over the prefix (as vLLM's block
    hashes are): equal ids mean equal tokens up to the chunk's end."""
    ids = []
    h = 0
    for end in range(CHUNK_TOKENS, len(prompt) + 1, CHUNK_TOKENS):
        h = hash((h, tuple(prompt[end - CHUNK_TOKENS : end])))
        ids.append(h)
    return ids


def _measure(trace: Trace, asked: list[Asked]) -> None:
    """The working set: before each request, the chunks of every session's context
    (the shared system prompt once), averaged over the requests."""
    trace.chunk_lists = [chunk_ids(p) for p in trace.prompts]
    system = SYSTEM_TOKENS // CHUNK_TOKENS
    in_play: dict[int, int] = {}  # session -> its context's chunks, the system's apart
    held = total = 0
    for session, prompt, kept in asked:
        if prompt:
            total += held + system
        chunks = kept // CHUNK_TOKENS - system
        held += chunks - in_play.get(session, 0)
        in_play[session] = chunks
    trace.working_set = total / len(trace.prompts)
    trace.footprint = len({c for chunks in trace.chunk_lists for c in chunks})
    trace.prompt_tokens = sum(len(p) for p in trace.prompts)


def make_trace(family: str, ratio: float, pool_chunks: int, requests: int, seed: int) -> Trace:
    """The family's trace of `requests` requests whose working set is nearest
    `ratio` x `pool_chunks` (the session count searched, the seed fixed)."""
    generate = GENERATORS[family]
    target = ratio * pool_chunks
    tried: dict[int, Trace] = {}

    def attempt(sessions: int) -> Trace:
        if sessions not in tried:
            asked = generate(sessions, requests, seed)
            trace = Trace(family, sessions, [p for _, p, _ in asked if p], ratio, pool_chunks)
            _measure(trace, asked)
            tried[sessions] = trace
        return tried[sessions]

    # The working set grows with the sessions: doubling, then halving, then the best.
    low, high = 0, 1
    while attempt(high).working_set < target and high < 16 * requests:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if attempt(mid).working_set < target:
            low = mid
        else:
            high = mid
    return min(tried.values(), key=lambda t: abs(t.working_set - target))


def lookup_chunks(prompt_len: int) -> int:
    """Chunks a lookup may hit: vLLM computes at least the prompt's last token."""
    return (prompt_len - 1) // CHUNK_TOKENS


def belady(trace: Trace, capacity: int) -> dict[str, int]:
    """Belady's MIN with bypass over the trace (see the module docstring): hit tokens
    and the chunks it stored (admitted)."""
    chunk_lists = trace.chunk_lists
    # Each chunk's uses, as request indexes, to find its next use after request i.
    uses: dict[int, list[int]] = {}
    for i, chunks in enumerate(chunk_lists):
        for c in chunks:
            uses.setdefault(c, []).append(i)
    cursor = dict.fromkeys(uses, 0)
    never = len(chunk_lists)
    # Depth breaks ties: a prefix's head is kept before its tail.
    depth: dict[int, int] = {}
    held: set[int] = set()
    hit_tokens = stored = 0
    for prompt, chunks in zip(trace.prompts, chunk_lists, strict=True):
        hits = 0
        for c in chunks[: lookup_chunks(len(prompt))]:
            if c not in held:
                break
            hits += 1
        hit_tokens += hits * CHUNK_TOKENS
        for d, c in enumerate(chunks):
            depth[c] = d
            cursor[c] += 1  # this use is past
        candidates = held | set(chunks)

        def next_use(c: int) -> tuple[int, int]:
            at = uses[c]
            k = cursor[c]
            return (at[k] if k < len(at) else never, depth[c])

        keep = sorted(candidates, key=next_use)[:capacity]
        keep = {c for c in keep if next_use(c)[0] < never}
        stored += len(keep - held)
        held = keep
    return {"hit_tokens": hit_tokens, "stored_chunks": stored}
