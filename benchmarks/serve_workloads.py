"""The serving benchmark's workloads: token-id prompts, seeded, no tokenizer or data set.

Each workload is a list of rounds; a round's requests may run side by side, and a
user's request of round r+1 is sent only after its request of round r has finished
(a chat user reads the answer before asking again). Server `i` of a request is an
index into the servers of the run.

The histories hold synthetic answers (seeded tokens of the answer's length), not the
generated ones: the workload is then the same for every setup, so outputs compare
request by request, and a setup's wrong output cannot change what it is asked next.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

#: token ids are drawn from [10, 10 + VOCAB): inside every model's vocabulary here
VOCAB = 30000


@dataclass(frozen=True)
class Request:
    workload: str
    user: int  # the user (QA) or the document (shared docs)
    round: int  # the round (QA) or the question's index (shared docs), from 1
    server: int
    prompt: tuple[int, ...]
    max_tokens: int
    phase: str = ""  # "before"/"after" for the restart workload


@dataclass
class Workload:
    name: str
    rounds: list[list[Request]]
    #: distinct prompt tokens (shared prefixes counted once): the KV the workload keeps
    working_set_tokens: int
    #: restart every server after this many rounds (0: never)
    restart_after: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [r for rnd in self.rounds for r in rnd]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [10 + rng.randrange(VOCAB) for _ in range(n)]


@dataclass(frozen=True)
class QAShape:
    """LMCache's multi-round QA shape: U users, a shared system prompt, a per-user
    context, and per round a question (and then its answer) added to the history."""

    users: int
    rounds: int
    system_tokens: int
    context_tokens: int
    question_tokens: int
    answer_tokens: int

    def prompt_tokens(self, rnd: int) -> int:
        """Length of round `rnd`'s prompt (from 1)."""
        return (
            self.system_tokens
            + self.context_tokens
            + rnd * self.question_tokens
            + (rnd - 1) * self.answer_tokens
        )


def multi_round_qa(
    shape: QAShape,
    servers: int,
    seed: int,
    name: str = "multi_round_qa",
    restart_after: int = 0,
) -> Workload:
    """User u's round r goes to server (u + r) % servers: round robin per user, as behind
    a plain load balancer, so a user's next round lands where its history is not."""
    rng = random.Random(seed)
    system = _tokens(rng, shape.system_tokens)
    histories = [system + _tokens(rng, shape.context_tokens) for _ in range(shape.users)]
    rounds: list[list[Request]] = []
    for r in range(1, shape.rounds + 1):
        batch = []
        for u in range(shape.users):
            if r > 1:
                histories[u] += _tokens(rng, shape.answer_tokens)
            histories[u] += _tokens(rng, shape.question_tokens)
            phase = ""
            if restart_after:
                phase = "before" if r <= restart_after else "after"
            batch.append(
                Request(
                    name,
                    u,
                    r,
                    (u + r) % servers,
                    tuple(histories[u]),
                    shape.answer_tokens,
                    phase,
                )
            )
        rounds.append(batch)
    working = shape.system_tokens + shape.users * (
        shape.prompt_tokens(shape.rounds) - shape.system_tokens
    )
    return Workload(name, rounds, working, restart_after)


@dataclass(frozen=True)
class DocsShape:
    """RAG-like: a few long documents, many short questions over each."""

    docs: int
    questions: int
    doc_tokens: int
    question_tokens: int
    answer_tokens: int


def shared_docs(shape: DocsShape, servers: int, seed: int) -> Workload:
    """Question q over document d goes to server (d + q) % servers; the q-th questions
    of all documents form round q."""
    rng = random.Random(seed)
    docs = [_tokens(rng, shape.doc_tokens) for _ in range(shape.docs)]
    rounds = [
        [
            Request(
                "shared_docs",
                d,
                q,
                (d + q) % servers,
                tuple(docs[d] + _tokens(rng, shape.question_tokens)),
                shape.answer_tokens,
            )
            for d in range(shape.docs)
        ]
        for q in range(1, shape.questions + 1)
    ]
    return Workload("shared_docs", rounds, shape.docs * shape.doc_tokens)


def fresh_prompts(seed: int, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of `length` tokens (the limit measurement's)."""
    rng = random.Random(seed)
    return [_tokens(rng, length) for _ in range(count)]
