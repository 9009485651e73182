"""The web apps the browser tasks run in: a shop, a sign-up form workflow and a todo list (aiohttp, 127.0.0.1).

Pages are server-rendered HTML with plain forms (no scripts), so every click that changes something is a request
and the server's :class:`AppState` is the whole truth the verifiers read. Each browser env runs its own
:class:`WebApps` server on a free port, and :meth:`WebApps.reset` puts the state back to a task's start.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Product:
    """One catalogue item."""

    id: str
    name: str
    category: str
    price_cents: int

    @property
    def price(self) -> str:
        """The price as shown, e.g. ``$4.50``."""
        return f"${self.price_cents // 100}.{self.price_cents % 100:02d}"


@dataclass
class TodoItem:
    """One todo: its text and whether it is done."""

    id: int
    text: str
    done: bool = False


@dataclass
class AppState:
    """Everything the apps hold; verifiers read it, :meth:`WebApps.reset` replaces it."""

    catalog: tuple[Product, ...] = ()
    cart: dict[str, int] = field(default_factory=dict)
    orders: list[dict[str, int]] = field(default_factory=list)
    form_draft: dict[str, Any] = field(default_factory=dict)
    form_submissions: list[dict[str, Any]] = field(default_factory=list)
    todos: list[TodoItem] = field(default_factory=list)
    next_todo_id: int = 1

    def todo_summary(self) -> list[tuple[str, bool]]:
        """(text, done) of each todo, in order."""
        return [(t.text, t.done) for t in self.todos]


PLANS = ("basic", "pro", "team")


def _page(title: str, body: str) -> web.Response:
    doc = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:16px;max-width:720px}li{margin:4px 0}"
        "form.inline{display:inline}.err{color:#b00}</style></head>"
        f"<body><nav><a href='/'>Home</a> | <a href='/shop'>Shop</a> | <a href='/form'>Sign up</a> | "
        f"<a href='/todo'>Todo</a></nav><main><h1>{html.escape(title)}</h1>{body}</main></body></html>"
    )
    return web.Response(text=doc, content_type="text/html")


def _button_form(action: str, label: str, aria: str, hidden: dict[str, Any]) -> str:
    fields = "".join(
        f"<input type='hidden' name='{html.escape(k)}' value='{html.escape(str(v))}'>" for k, v in hidden.items()
    )
    return (
        f"<form class='inline' method='post' action='{action}'>{fields}"
        f"<button aria-label='{html.escape(aria)}'>{html.escape(label)}</button></form>"
    )


def _see_other(location: str) -> web.HTTPSeeOther:
    return web.HTTPSeeOther(location)


class WebApps:
    """The three apps on one aiohttp server; ``state`` is replaced at each :meth:`reset`."""

    def __init__(self) -> None:
        self.state = AppState()
        self.app = web.Application()
        r = self.app.router
        r.add_get("/", self.home)
        r.add_get("/shop", self.shop_home)
        r.add_get("/shop/search", self.shop_search)
        r.add_get("/shop/product/{pid}", self.shop_product)
        r.add_post("/shop/cart/add", self.cart_add)
        r.add_post("/shop/cart/remove", self.cart_remove)
        r.add_get("/shop/cart", self.cart_view)
        r.add_post("/shop/checkout", self.checkout)
        r.add_get("/form", self.form_step1)
        r.add_post("/form/step1", self.form_step1_post)
        r.add_get("/form/step2", self.form_step2)
        r.add_post("/form/step2", self.form_step2_post)
        r.add_get("/form/review", self.form_review)
        r.add_post("/form/submit", self.form_submit)
        r.add_get("/todo", self.todo_list)
        r.add_post("/todo/add", self.todo_add)
        r.add_post("/todo/toggle", self.todo_toggle)
        r.add_post("/todo/delete", self.todo_delete)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        """Listen on a free port of 127.0.0.1; returns the origin (``http://127.0.0.1:PORT``)."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.origin

    @property
    def origin(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def reset(self, catalog: tuple[Product, ...], todos: list[str], done: tuple[str, ...] = ()) -> None:
        """A fresh state: ``catalog`` in the shop, ``todos`` in the todo list (those in ``done`` ticked)."""
        items = [TodoItem(i + 1, t, t in done) for i, t in enumerate(todos)]
        self.state = AppState(catalog=catalog, todos=items, next_todo_id=len(items) + 1)

    # -- home and shop -----------------------------------------------------------------------------------------
    async def home(self, request: web.Request) -> web.Response:
        return _page(
            "Home", "<p>Apps: <a href='/shop'>Shop</a>, <a href='/form'>Sign up</a>, <a href='/todo'>Todo</a></p>"
        )

    def _product_li(self, p: Product) -> str:
        add = _button_form("/shop/cart/add", "Add to cart", f"Add {p.name} to cart", {"pid": p.id, "qty": 1})
        link = f"<a href='/shop/product/{p.id}'>{html.escape(p.name)}</a>"
        return f"<li>{link} ({html.escape(p.category)}) {p.price} {add}</li>"

    def _search_form(self, q: str = "") -> str:
        return (
            "<form method='get' action='/shop/search' role='search'>"
            f"<input name='q' aria-label='Search products' value='{html.escape(q)}'>"
            "<button>Search</button></form>"
        )

    async def shop_home(self, request: web.Request) -> web.Response:
        cats = sorted({p.category for p in self.state.catalog})
        links = " ".join(f"<a href='/shop/search?q={html.escape(c)}'>{html.escape(c)}</a>" for c in cats)
        cart_n = sum(self.state.cart.values())
        body = (
            f"{self._search_form()}<p>Categories: {links}</p><p><a href='/shop/cart'>Cart ({cart_n})</a></p>"
            "<p><a href='https://partner.example.com/deals'>Partner deals</a></p>"
        )
        return _page("Shop", body)

    async def shop_search(self, request: web.Request) -> web.Response:
        q = request.query.get("q", "").strip()
        words = q.lower().split()
        hits = [p for p in self.state.catalog if all(w in f"{p.name} {p.category}".lower() for w in words)]
        items = "".join(self._product_li(p) for p in hits) or "<li>No products found.</li>"
        body = f"{self._search_form(q)}<p>{len(hits)} result(s)</p><ul>{items}</ul><a href='/shop/cart'>Cart</a>"
        return _page(f"Search: {q}", body)

    def _product(self, pid: str) -> Product:
        for p in self.state.catalog:
            if p.id == pid:
                return p
        raise web.HTTPNotFound(text=f"no product {pid}")

    async def shop_product(self, request: web.Request) -> web.Response:
        p = self._product(request.match_info["pid"])
        body = (
            f"<p>{html.escape(p.name)}: {p.price} ({html.escape(p.category)})</p>"
            "<form method='post' action='/shop/cart/add'>"
            f"<input type='hidden' name='pid' value='{p.id}'>"
            "<label>Quantity <input type='number' name='qty' value='1' min='1' max='20'></label>"
            f"<button aria-label='Add {html.escape(p.name)} to cart'>Add to cart</button></form>"
        )
        return _page(p.name, body)

    async def cart_add(self, request: web.Request) -> web.Response:
        data = await request.post()
        p = self._product(str(data.get("pid", "")))
        try:
            qty = max(1, min(20, int(str(data.get("qty", "1")))))
        except ValueError:
            qty = 1
        self.state.cart[p.id] = self.state.cart.get(p.id, 0) + qty
        raise _see_other("/shop/cart")

    async def cart_remove(self, request: web.Request) -> web.Response:
        data = await request.post()
        self.state.cart.pop(str(data.get("pid", "")), None)
        raise _see_other("/shop/cart")

    async def cart_view(self, request: web.Request) -> web.Response:
        rows, total = [], 0
        for pid, qty in self.state.cart.items():
            p = self._product(pid)
            total += qty * p.price_cents
            rm = _button_form("/shop/cart/remove", "Remove", f"Remove {p.name}", {"pid": p.id})
            rows.append(f"<li>{html.escape(p.name)} x {qty} {rm}</li>")
        if not rows:
            return _page("Cart", "<p>Your cart is empty.</p><a href='/shop'>Continue shopping</a>")
        checkout = _button_form("/shop/checkout", "Check out", "Check out", {})
        body = f"<ul>{''.join(rows)}</ul><p>Total: ${total // 100}.{total % 100:02d}</p>{checkout}"
        return _page("Cart", body + "<p><a href='/shop'>Continue shopping</a></p>")

    async def checkout(self, request: web.Request) -> web.Response:
        if not self.state.cart:
            raise _see_other("/shop/cart")
        self.state.orders.append(dict(self.state.cart))
        self.state.cart = {}
        n = len(self.state.orders)
        return _page("Order placed", f"<p>Thank you! Order #{n} has been placed.</p><a href='/shop'>Back to shop</a>")

    # -- sign-up form workflow ---------------------------------------------------------------------------------
    async def form_step1(self, request: web.Request, error: str = "") -> web.Response:
        d = self.state.form_draft
        err = f"<p class='err' role='alert'>{html.escape(error)}</p>" if error else ""
        body = (
            f"{err}<form method='post' action='/form/step1'>"
            f"<p><label>Full name <input name='name' value='{html.escape(d.get('name', ''))}'></label></p>"
            f"<p><label>Email <input name='email' value='{html.escape(d.get('email', ''))}'></label></p>"
            "<button>Next</button></form>"
        )
        return _page("Sign up: step 1 of 3", body)

    async def form_step1_post(self, request: web.Request) -> web.Response:
        data = await request.post()
        name, email = str(data.get("name", "")).strip(), str(data.get("email", "")).strip()
        self.state.form_draft.update(name=name, email=email)
        if not name:
            return await self.form_step1(request, "Please enter your full name.")
        if "@" not in email or "." not in email.rsplit("@", 1)[-1]:
            return await self.form_step1(request, "Please enter a valid email address.")
        raise _see_other("/form/step2")

    async def form_step2(self, request: web.Request) -> web.Response:
        d = self.state.form_draft
        if not d.get("email"):
            raise _see_other("/form")
        radios = "".join(
            f"<p><label><input type='radio' name='plan' value='{p}'{' checked' if d.get('plan') == p else ''}>"
            f" {p.capitalize()} plan</label></p>"
            for p in PLANS
        )
        news = " checked" if d.get("newsletter") else ""
        body = (
            f"<form method='post' action='/form/step2'><fieldset><legend>Plan</legend>{radios}</fieldset>"
            f"<p><label><input type='checkbox' name='newsletter' value='yes'{news}> Send me the newsletter</label></p>"
            "<button>Next</button></form><p><a href='/form'>Back to step 1</a></p>"
        )
        return _page("Sign up: step 2 of 3", body)

    async def form_step2_post(self, request: web.Request) -> web.Response:
        data = await request.post()
        plan = str(data.get("plan", ""))
        self.state.form_draft.update(plan=plan if plan in PLANS else "", newsletter=data.get("newsletter") == "yes")
        raise _see_other("/form/review" if plan in PLANS else "/form/step2")

    async def form_review(self, request: web.Request) -> web.Response:
        d = self.state.form_draft
        if not d.get("plan"):
            raise _see_other("/form/step2")
        rows = "".join(f"<li>{k}: {html.escape(str(d.get(k)))}</li>" for k in ("name", "email", "plan", "newsletter"))
        submit = _button_form("/form/submit", "Submit", "Submit", {})
        body = f"<ul>{rows}</ul>{submit}<p><a href='/form/step2'>Back to step 2</a></p>"
        return _page("Sign up: review", body)

    async def form_submit(self, request: web.Request) -> web.Response:
        d = self.state.form_draft
        if not (d.get("name") and d.get("email") and d.get("plan")):
            raise _see_other("/form")
        self.state.form_submissions.append(dict(d))
        self.state.form_draft = {}
        return _page("Signed up", f"<p>Welcome, {html.escape(d['name'])}! You are on the {d['plan']} plan.</p>")

    # -- todo list ---------------------------------------------------------------------------------------------
    async def todo_list(self, request: web.Request) -> web.Response:
        rows = []
        for t in self.state.todos:
            label = "Undo" if t.done else "Done"
            toggle = _button_form("/todo/toggle", label, f"{label} {t.text}", {"id": t.id})
            delete = _button_form("/todo/delete", "Delete", f"Delete {t.text}", {"id": t.id})
            text = f"<s>{html.escape(t.text)}</s> (done)" if t.done else html.escape(t.text)
            rows.append(f"<li>{text} {toggle} {delete}</li>")
        items = "".join(rows) or "<li>Nothing to do.</li>"
        add = (
            "<form method='post' action='/todo/add'><input name='text' aria-label='New todo'>"
            "<button>Add</button></form>"
        )
        return _page("Todo", f"<ul>{items}</ul>{add}")

    async def todo_add(self, request: web.Request) -> web.Response:
        text = str((await request.post()).get("text", "")).strip()
        if text:
            self.state.todos.append(TodoItem(self.state.next_todo_id, text[:200]))
            self.state.next_todo_id += 1
        raise _see_other("/todo")

    def _todo(self, data: Any) -> TodoItem | None:
        try:
            tid = int(str(data.get("id", "")))
        except ValueError:
            return None
        return next((t for t in self.state.todos if t.id == tid), None)

    async def todo_toggle(self, request: web.Request) -> web.Response:
        item = self._todo(await request.post())
        if item is not None:
            item.done = not item.done
        raise _see_other("/todo")

    async def todo_delete(self, request: web.Request) -> web.Response:
        item = self._todo(await request.post())
        if item is not None:
            self.state.todos.remove(item)
        raise _see_other("/todo")
