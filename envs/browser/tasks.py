"""Browser tasks: what to do in the shipped web apps, how the app's server state proves it, and a scripted expert.

Task types: ``shop_buy`` (buy N of a named product), ``shop_cheapest`` (buy the cheapest product of a category),
``form`` (a three-step sign-up), ``todo`` (add, tick and delete items). Every task is drawn from its seed, and
verified only from :class:`~envs.browser.apps.AppState` (never from the agent's words).

The expert acts through the page like an agent would: each step names an element by ARIA role and accessible name,
and the ref to act on is looked up in the current observation's snapshot.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from envs.browser.apps import PLANS, AppState, Product
from envs.core import answer_action, tool_action

TASK_TYPES: tuple[str, ...] = ("shop_buy", "shop_cheapest", "form", "todo")
START_PATH = {"shop_buy": "/shop", "shop_cheapest": "/shop", "form": "/form", "todo": "/todo"}

_PRODUCTS = (
    ("red-mug", "Red mug", "mugs"),
    ("blue-mug", "Blue mug", "mugs"),
    ("travel-mug", "Travel mug", "mugs"),
    ("green-tea", "Green tea", "tea"),
    ("black-tea", "Black tea", "tea"),
    ("jasmine-tea", "Jasmine tea", "tea"),
    ("lined-notebook", "Lined notebook", "notebooks"),
    ("dotted-notebook", "Dotted notebook", "notebooks"),
    ("pocket-notebook", "Pocket notebook", "notebooks"),
    ("gel-pen", "Gel pen", "pens"),
    ("fountain-pen", "Fountain pen", "pens"),
    ("brush-pen", "Brush pen", "pens"),
)
_FIRST = ("Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken")
_LAST = ("Lovelace", "Turing", "Hopper", "Dijkstra", "Liskov", "Knuth", "Allen", "Backus", "Perlman", "Thompson")
_TODOS = (
    "buy milk",
    "call mom",
    "pay rent",
    "water plants",
    "book dentist",
    "fix bike",
    "read paper",
    "send invoice",
    "clean desk",
    "renew passport",
)


@dataclass(frozen=True)
class BrowserTask:
    """One web task; ``goal`` is what the verifier compares the app's state with."""

    task_id: str
    task_type: str
    prompt: str
    start_path: str
    catalog: tuple[Product, ...]
    todos: tuple[str, ...] = ()
    goal: dict[str, Any] = field(default_factory=dict)


def make_catalog(rng: random.Random) -> tuple[Product, ...]:
    """The shop's catalogue with prices drawn from ``rng`` (distinct within a category, so 'cheapest' is unique)."""
    out = []
    for cat in sorted({c for _, _, c in _PRODUCTS}):
        items = [(pid, name) for pid, name, c in _PRODUCTS if c == cat]
        prices = rng.sample(range(150, 3000, 5), len(items))
        out += [Product(pid, name, cat, price) for (pid, name), price in zip(items, prices, strict=True)]
    return tuple(out)


def make_task(task_seed: int, split: str, task_type: str | None = None) -> BrowserTask:
    """The task of ``task_seed`` (deterministic); ``task_type`` forces the type."""
    rng = random.Random(task_seed)
    kind = task_type if task_type is not None else rng.choice(TASK_TYPES)
    if kind not in TASK_TYPES:
        raise ValueError(f"unknown browser task type {kind!r}; expected one of {TASK_TYPES}")
    catalog = make_catalog(rng)
    tid = f"browser-{split}-{task_seed}"
    start = START_PATH[kind]
    if kind == "shop_buy":
        p, qty = rng.choice(catalog), rng.randint(1, 4)
        prompt = f"In the shop, buy {qty} of the product '{p.name}' (add them to the cart and check out)."
        return BrowserTask(tid, kind, prompt, start, catalog, goal={"orders": [{p.id: qty}]})
    if kind == "shop_cheapest":
        cat = rng.choice(sorted({p.category for p in catalog}))
        cheapest = min((p for p in catalog if p.category == cat), key=lambda p: p.price_cents)
        prompt = f"In the shop, buy one of the cheapest product in the category '{cat}' and check out."
        return BrowserTask(tid, kind, prompt, start, catalog, goal={"orders": [{cheapest.id: 1}]})
    if kind == "form":
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        email = f"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@example.org"
        plan, news = rng.choice(PLANS), rng.random() < 0.5
        want = {"name": f"{first} {last}", "email": email, "plan": plan, "newsletter": news}
        news_text = "with" if news else "without"
        prompt = f"Sign up {first} {last} ({email}) for the {plan} plan, {news_text} the newsletter, and submit."
        return BrowserTask(tid, kind, prompt, start, catalog, goal={"submissions": [want]})
    names = rng.sample(_TODOS, 5)
    start_items, new = names[:4], names[4]
    tick, delete = rng.sample(start_items, 2)
    final = [(t, t == tick) for t in start_items if t != delete] + [(new, False)]
    prompt = f"In the todo list, add '{new}', mark '{tick}' as done, and delete '{delete}'."
    return BrowserTask(tid, kind, prompt, start, catalog, tuple(start_items), goal={"todos": final})


def check_state(task: BrowserTask, state: AppState) -> dict[str, bool]:
    """Each goal condition and whether the app's state meets it (the task succeeds when all hold)."""
    checks: dict[str, bool] = {}
    if "orders" in task.goal:
        checks["orders"] = state.orders == task.goal["orders"]
        checks["cart_empty"] = not state.cart
    if "submissions" in task.goal:
        checks["submissions"] = state.form_submissions == task.goal["submissions"]
    if "todos" in task.goal:
        checks["todos"] = state.todo_summary() == [tuple(t) for t in task.goal["todos"]]
    return checks


# -- the scripted expert -----------------------------------------------------------------------------------------
Step = tuple[str, str, str, dict[str, Any]]
"""(tool, ARIA role, accessible name, extra arguments): e.g. ("click", "button", "Check out", {})."""

_REF_LINE = re.compile(r'^\s*- (?P<role>[\w-]+) "(?P<name>(?:[^"\\]|\\.)*)".*?\[ref=(?P<ref>[\w-]+)\]')


def find_ref(snapshot: str, role: str, name: str) -> str | None:
    """The ref of the first element with ``role`` and accessible ``name`` in an ARIA snapshot, or None."""
    for line in snapshot.splitlines():
        m = _REF_LINE.match(line)
        if m and m.group("role") == role and m.group("name") == name:
            return m.group("ref")
    return None


def expert_plan(task: BrowserTask) -> list[Step]:
    """The steps that solve ``task`` from its start page."""
    if task.task_type in ("shop_buy", "shop_cheapest"):
        ((pid, qty),) = task.goal["orders"][0].items()
        p = next(p for p in task.catalog if p.id == pid)
        return [
            ("type", "textbox", "Search products", {"text": p.name, "submit": True}),
            ("click", "link", p.name, {}),
            ("type", "spinbutton", "Quantity", {"text": str(qty)}),
            ("click", "button", f"Add {p.name} to cart", {}),
            ("click", "button", "Check out", {}),
        ]
    if task.task_type == "form":
        want = task.goal["submissions"][0]
        steps: list[Step] = [
            ("type", "textbox", "Full name", {"text": want["name"]}),
            ("type", "textbox", "Email", {"text": want["email"]}),
            ("click", "button", "Next", {}),
            ("click", "radio", f"{want['plan'].capitalize()} plan", {}),
        ]
        if want["newsletter"]:
            steps.append(("click", "checkbox", "Send me the newsletter", {}))
        return [*steps, ("click", "button", "Next", {}), ("click", "button", "Submit", {})]
    final = dict(task.goal["todos"])
    new = next(t for t in final if t not in task.todos)
    tick = next(t for t, done in final.items() if done)
    delete = next(t for t in task.todos if t not in final)
    return [
        ("type", "textbox", "New todo", {"text": new, "submit": True}),
        ("click", "button", f"Done {tick}", {}),
        ("click", "button", f"Delete {delete}", {}),
    ]


def expert_action(env: Any, history: list[tuple[str, str]]) -> str:
    """The scripted expert's next action: step ``len(history)`` of the plan, its ref read from the last observation.

    When the plan is done, or an element cannot be found, it answers ``"done"`` (the verifier decides).
    """
    base = env.unwrapped
    plan = expert_plan(base.task)
    i = len(history)
    if i >= len(plan):
        return answer_action("done")
    tool, role, name, extra = plan[i]
    ref = find_ref(base.last_observation, role, name)
    if ref is None:
        return answer_action("done")
    return tool_action(tool, {"ref": ref, **extra})
