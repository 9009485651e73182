"""The document collection of ``agentflow/Retrieval-v0``: synthetic facts, generated deterministically.

Fictional cities, people and inventions (so no model can know the answers without searching), written as short
documents with the facts beside them. The file ``envs/data/retrieval_docs.jsonl`` ships with the project; it is
exactly ``generate_documents()`` (a test checks it). Regenerate with ``python -m envs.retrieval_data``.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).resolve().parent / "data" / "retrieval_docs.jsonl"
N_CITIES, N_PEOPLE, N_INVENTIONS = 100, 120, 80
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "sk"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "th", "sk", "nd"]
_PROFESSIONS = ["glassblower", "botanist", "cartographer", "clockmaker", "engineer", "chemist", "weaver", "printer"]
_KINDS = ["lamp", "loom", "compass", "kettle", "press", "lens", "clock", "pump", "valve", "kiln", "sextant", "bellows"]
_MATERIALS = ["brass", "oak", "glass", "copper", "iron", "bone", "tin", "walnut"]
_RIVERS = ["Tesk", "Arvel", "Moun", "Dresa", "Kalt", "Ibbe", "Sorn", "Velm"]


def _name(rng: random.Random, parts: int) -> str:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(parts - 1))
    return (word + rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)).capitalize()


def _unique_names(rng: random.Random, n: int, parts: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = _name(rng, parts)
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def generate_documents(seed: int = 0) -> list[dict[str, Any]]:
    """All documents: ``{"id", "kind", "title", "text", "facts"}`` for cities, then people, then inventions."""
    rng = random.Random(seed)
    taken: set[str] = set()
    provinces = _unique_names(rng, 10, 3, taken)
    docs: list[dict[str, Any]] = []
    cities = []
    for name in _unique_names(rng, N_CITIES, 2, taken):
        f = {"name": name, "province": rng.choice(provinces), "founded": rng.randint(1200, 1840),
             "population": rng.randint(2_000, 900_000), "river": rng.choice(_RIVERS)}  # fmt: skip
        cities.append(f)
        text = (f"{name} is a city in the province of {f['province']}, on the river {f['river']}. It was founded in "
                f"{f['founded']} and has a population of {f['population']:,}.")  # fmt: skip
        docs.append({"kind": "city", "title": name, "text": text, "facts": f})
    people = []
    for first, last in zip(_unique_names(rng, N_PEOPLE, 2, taken), _unique_names(rng, N_PEOPLE, 2, taken), strict=True):
        city = rng.choice(cities)
        f = {"name": f"{first} {last}", "profession": rng.choice(_PROFESSIONS), "birth_city": city["name"],
             "born": rng.randint(1850, 1990)}  # fmt: skip
        people.append(f)
    for inv_name, person in zip(
        _unique_names(rng, N_INVENTIONS, 2, taken), rng.sample(people, N_INVENTIONS), strict=True
    ):
        kind = rng.choice(_KINDS)
        f = {"name": f"{inv_name} {kind}", "inventor": person["name"], "year": person["born"] + rng.randint(20, 60),
             "material": rng.choice(_MATERIALS)}  # fmt: skip
        person["known_for"] = f["name"]
        text = (f"The {f['name']} is a {kind} made of {f['material']}. It was invented by {person['name']} in "
                f"{f['year']}.")  # fmt: skip
        docs.append({"kind": "invention", "title": f"{f['name']}", "text": text, "facts": f})
    for f in people:
        text = f"{f['name']} is a {f['profession']} born in {f['birth_city']} in {f['born']}."
        if "known_for" in f:
            text += f" {f['name'].split()[1]} is best known for the {f['known_for']}."
        docs.append({"kind": "person", "title": f["name"], "text": text, "facts": f})
    return [{"id": f"doc-{i:04d}", **d} for i, d in enumerate(docs)]


def write_documents(path: Path = DATA_FILE, seed: int = 0) -> None:
    """Write the collection as JSON lines (sorted keys: byte-for-byte reproducible)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(d, sort_keys=True, ensure_ascii=False) for d in generate_documents(seed)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def load_documents(path: Path = DATA_FILE) -> list[dict[str, Any]]:
    """Read the shipped collection."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


_TOKEN_RE = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric tokens (thousands separators dropped: "48,213" -> "48213")."""
    return _TOKEN_RE.findall(re.sub(r"(?<=\d),(?=\d)", "", text.lower()))


@dataclass
class BM25Index:
    """A small in-memory BM25 index over ``title + text`` of the documents."""

    docs: list[dict[str, Any]]
    k1: float = 1.5
    b: float = 0.75

    def __post_init__(self) -> None:
        self._tf = [Counter(tokenize(f"{d['title']} {d['text']}")) for d in self.docs]
        self._len = [sum(tf.values()) for tf in self._tf]
        self._avg = sum(self._len) / max(len(self._len), 1)
        df: Counter[str] = Counter()
        for tf in self._tf:
            df.update(tf.keys())
        n = len(self.docs)
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def search(self, query: str, k: int = 3) -> list[tuple[float, dict[str, Any]]]:
        """The ``k`` best (score, document) pairs for ``query`` (ties broken by document order)."""
        terms = tokenize(query)
        scored = []
        for i, tf in enumerate(self._tf):
            s = 0.0
            for t in terms:
                if t in tf:
                    norm = tf[t] + self.k1 * (1 - self.b + self.b * self._len[i] / self._avg)
                    s += self._idf[t] * tf[t] * (self.k1 + 1) / norm
            if s > 0:
                scored.append((s, i))
        scored.sort(key=lambda p: (-p[0], p[1]))
        return [(s, self.docs[i]) for s, i in scored[:k]]


if __name__ == "__main__":
    write_documents()
    print(f"wrote {DATA_FILE} ({len(generate_documents())} documents)")
