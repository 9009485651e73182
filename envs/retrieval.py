"""``agentflow/Retrieval-v0``: questions about a fictional world, answered by searching a local collection.

The collection (``envs/data/retrieval_docs.jsonl``, see :mod:`envs.retrieval_data`) describes made-up cities,
people and inventions, so the answers cannot be known without the ``search`` tool. Some questions need two or
three searches (the inventor of X -> where they were born -> that city's province) and one kind needs a
subtraction, for which a sandboxed ``python`` tool is offered.
"""

from __future__ import annotations

import functools
import random
import re
import zlib
from dataclasses import dataclass
from typing import Any

from envs.core import answer_action, tool_action
from envs.errors import ActionError
from envs.retrieval_data import BM25Index, load_documents
from envs.sandbox import Limits
from envs.sandboxed import SandboxToolEnv, describe_result
from envs.tasks import simple_task_set
from envs.tools import tool
from envs.verifiers import Rubric, normalize_text, used_tool

TASK_TYPES = ("city_founded", "city_population", "birth_city", "inventor_city", "inventor_province", "years_after")
MAX_CODE_CHARS = 4000


@dataclass(frozen=True)
class QATask:
    """One question; ``queries`` are searches that find the needed documents (the scripted expert uses them)."""

    task_id: str
    task_type: str
    prompt: str
    answer: str
    queries: tuple[str, ...]
    doc_ids: tuple[str, ...]
    compute: str = ""


@functools.cache
def corpus() -> tuple[BM25Index, dict[str, dict[str, Any]]]:
    """The shipped collection's index and a title -> document map (loaded once per process)."""
    docs = load_documents()
    return BM25Index(docs), {d["title"]: d for d in docs}


_SUBJECT_KIND = {"city_founded": "city", "city_population": "city", "birth_city": "person"}
EVAL_SHARE = 5
"""One question in ``EVAL_SHARE`` (by a stable hash of its kind and subject) belongs to the eval split."""


def question_split(task_type: str, doc_id: str) -> str:
    """The split of the question of ``task_type`` about document ``doc_id``: train and eval never share one."""
    return "eval" if zlib.crc32(f"{task_type}:{doc_id}".encode()) % EVAL_SHARE == 0 else "train"


@functools.cache
def _subjects(task_type: str, split: str) -> tuple[dict[str, Any], ...]:
    kind = _SUBJECT_KIND.get(task_type, "invention")
    docs = corpus()[0].docs
    return tuple(d for d in docs if d["kind"] == kind and question_split(task_type, d["id"]) == split)


def _question(kind: str, split: str, rng: random.Random) -> tuple[str, str, list[dict[str, Any]], str]:
    """(question, answer, documents in the order they are needed, python code for the arithmetic if any)."""
    subject = rng.choice(_subjects(kind, "eval" if split == "eval" else "train"))
    if kind == "city_founded":
        c = subject
        return f"In what year was the city of {c['title']} founded?", str(c["facts"]["founded"]), [c], ""
    if kind == "city_population":
        c = subject
        return f"What is the population of {c['title']}?", str(c["facts"]["population"]), [c], ""
    if kind == "birth_city":
        p = subject
        return f"In which city was {p['title']} born?", p["facts"]["birth_city"], [p], ""
    by_title = corpus()[1]
    inv = subject
    person = by_title[inv["facts"]["inventor"]]
    city = by_title[person["facts"]["birth_city"]]
    if kind == "inventor_city":
        return f"In which city was the inventor of the {inv['title']} born?", city["title"], [inv, person], ""
    if kind == "inventor_province":
        q = f"In which province was the inventor of the {inv['title']} born?"
        return q, city["facts"]["province"], [inv, person, city], ""
    born, founded = person["facts"]["born"], city["facts"]["founded"]
    q = f"How many years after the founding of their birth city was the inventor of the {inv['title']} born?"
    return q, str(born - founded), [inv, person, city], f"print({born} - {founded})"


def make_qa_task(task_seed: int, split: str, task_type: str | None = None) -> QATask:
    """The question of ``task_seed`` in ``split`` (deterministic); ``task_type`` forces its kind.

    The collection allows only a few hundred distinct questions, so besides disjoint seeds the questions
    themselves are split (:func:`question_split`): no eval question is ever a train question.
    """
    rng = random.Random(f"retrieval:{task_seed}")
    kind = task_type or rng.choice(TASK_TYPES)
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown Retrieval task type {kind!r}; expected one of {TASK_TYPES}")
    question, answer, docs, compute = _question(kind, split, rng)
    prompt = f"{question}\nSearch the document collection with the search tool. Answer with the value only."
    queries = tuple(d["title"] for d in docs)
    return QATask(
        f"retrieval-{split}-{task_seed}", kind, prompt, answer, queries, tuple(d["id"] for d in docs), compute
    )


def _answer_correct(answer: str, task: QATask, env: Any) -> float:
    text = answer.strip().rstrip(".")
    if re.fullmatch(r"-?\d+", task.answer):
        digits = text.replace(",", "").replace(" ", "")
        return float(re.fullmatch(r"[+-]?\d+", digits) is not None and int(digits) == int(task.answer))
    return float(normalize_text(text) == normalize_text(task.answer))


class RetrievalEnv(SandboxToolEnv):
    """``agentflow/Retrieval-v0``: ``search(query, k)`` over the shipped collection, ``python(code)`` to compute."""

    system_prompt = (
        "Answer questions about a fictional world. Use the search tool to find documents (you know nothing "
        "about this world otherwise); use python for arithmetic. Answer with the value only."
    )
    max_turns = 8
    task_sets = {
        "default": simple_task_set(task_types=TASK_TYPES, description="one- to three-hop questions"),
        "single_hop": simple_task_set(
            "single_hop", offset=10_000_000, task_types=TASK_TYPES[:3], description="one search suffices"
        ),
    }
    rubric = Rubric([(1.0, _answer_correct, "answer_correct"), (0.0, used_tool("search"), "used_search")])
    sandbox_limits = Limits(memory_mb=256, cpu_s=5, file_size_mb=1, max_procs=16, output_kb=16)

    def make_task(self, task_seed: int, split: str, task_set: str) -> QATask:
        """The question of ``task_seed``; the ``single_hop`` set draws only one-search kinds."""
        kind = None
        if task_set == "single_hop":
            kind = random.Random(f"retrieval-kind:{task_seed}").choice(TASK_TYPES[:3])
        return make_qa_task(task_seed, split, kind)

    @tool
    def search(self, query: str, k: int = 3) -> str:
        """Search the document collection; returns the best matching documents with their ids.

        Args:
            query: Words to look for, e.g. a name.
            k: How many documents to return (1 to 10).
        """
        if not 1 <= k <= 10:
            raise ActionError(f"k must be between 1 and 10, got {k}")
        hits = corpus()[0].search(query, k)
        if not hits:
            return "No documents match."
        return "\n".join(f"[{d['id']}] {d['title']}: {d['text']}" for _, d in hits)

    @tool
    async def python(self, code: str) -> str:
        """Run a short Python script in a sandbox (no network) and return its output, e.g. for arithmetic.

        Args:
            code: The script, e.g. "print(1987 - 1742)".
        """
        if len(code) > MAX_CODE_CHARS:
            raise ActionError(f"code is too long ({len(code)} > {MAX_CODE_CHARS} characters)")
        result = await self.run(["python3", "-I", "-c", code], timeout=5.0)
        return result.stdout.strip() if result.ok and result.stdout.strip() else describe_result(result)


def expert_action(env: RetrievalEnv, history: list[tuple[str, str]]) -> str:
    """A scripted expert: searches each needed document's title in turn, computes if needed, then answers."""
    task: QATask = env.unwrapped.task
    if len(history) < len(task.queries):
        return tool_action("search", {"query": task.queries[len(history)], "k": 3})
    if task.compute and len(history) == len(task.queries):
        return tool_action("python", {"code": task.compute})
    return answer_action(history[-1][1].strip() if task.compute else task.answer)
