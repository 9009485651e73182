"""Small Tk desktop apps for the desktop env: a calculator and a text editor, each with a control socket.

Run as ``python -m envs.desktop.apps KIND SOCKET_PATH INIT_JSON`` on an X display. The window sits at (0, 0)
(there is no window manager), so widget positions are screen positions. The control socket (a Unix socket; one
JSON request per connection) answers ``{"op": "tree"}`` with the widget tree (class, name, text, screen box, focus)
and ``{"op": "state"}`` with the app's state, which is what verifiers read. Before answering, the app processes
its pending X events, so a reply reflects every input the X server has delivered.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import socket
import sys
import tkinter as tk
from typing import Any

WIDTH, HEIGHT = 480, 360
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / and parentheses (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not an arithmetic expression")

    return ev(ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval"))


def format_number(value: float) -> str:
    """``12`` for whole numbers, else up to 10 significant digits."""
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


class Calculator:
    """A keypad calculator: digits and operators build an expression, ``=`` evaluates it, ``C`` clears."""

    KEYS = ("7", "8", "9", "/", "4", "5", "6", "*", "1", "2", "3", "-", "0", ".", "=", "+", "C", "(", ")", "<")

    def __init__(self, root: tk.Tk, init: dict[str, Any]) -> None:
        root.title("Calculator")
        self.expr = tk.StringVar(value="")
        self.history: list[dict[str, str]] = []
        disp = tk.Entry(root, name="display", textvariable=self.expr, font=("TkFixedFont", 20), justify="right")
        disp.configure(insertofftime=0)
        disp.grid(row=0, column=0, columnspan=4, sticky="nsew", padx=6, pady=6)
        for i, key in enumerate(self.KEYS):
            name = {"<": "backspace", "=": "equals", "C": "clear"}.get(key, f"key{ord(key)}")
            b = tk.Button(root, name=name, text=key, font=("TkDefaultFont", 16), command=lambda k=key: self.press(k))
            b.grid(row=1 + i // 4, column=i % 4, sticky="nsew", padx=2, pady=2)
        for c in range(4):
            root.columnconfigure(c, weight=1)
        for r in range(6):
            root.rowconfigure(r, weight=1)
        root.bind("<Return>", lambda e: self.press("="))
        root.bind("<KP_Enter>", lambda e: self.press("="))
        root.bind("<Escape>", lambda e: self.press("C"))
        disp.focus_set()

    def press(self, key: str) -> str:
        if key == "C":
            self.expr.set("")
        elif key == "<":
            self.expr.set(self.expr.get()[:-1])
        elif key == "=":
            text = self.expr.get()
            try:
                result = format_number(evaluate(text))
            except (ValueError, SyntaxError, ZeroDivisionError):
                result = "Error"
            self.history.append({"expression": text, "result": result})
            self.expr.set(result)
        else:
            self.expr.set(self.expr.get() + key)
        return "break"

    def state(self) -> dict[str, Any]:
        return {"display": self.expr.get(), "history": list(self.history)}


class Editor:
    """A one-file text editor: a file-name field, a text area and Save (also Ctrl+S); saves are kept in memory."""

    def __init__(self, root: tk.Tk, init: dict[str, Any]) -> None:
        root.title("Editor")
        bar = tk.Frame(root, name="bar")
        bar.pack(side="top", fill="x")
        tk.Label(bar, name="filename_label", text="File name:").pack(side="left", padx=4)
        self.name = tk.Entry(bar, name="filename", width=24, insertofftime=0)
        self.name.insert(0, init.get("filename", "untitled.txt"))
        self.name.pack(side="left", padx=4, pady=4)
        tk.Button(bar, name="save", text="Save", command=self.save).pack(side="left", padx=4)
        self.status = tk.Label(bar, name="status", text="")
        self.status.pack(side="left", padx=4)
        self.text = tk.Text(root, name="text", undo=True, insertofftime=0, font=("TkFixedFont", 12))
        self.text.insert("1.0", init.get("text", ""))
        self.text.pack(side="top", fill="both", expand=True, padx=4, pady=4)
        self.saved: dict[str, str] = {}
        root.bind_all("<Control-s>", lambda e: self.save() or "break")
        self.text.focus_set()

    def save(self) -> None:
        name = self.name.get().strip()
        if not name:
            self.status.configure(text="Enter a file name")
            return
        self.saved[name] = self.text.get("1.0", "end-1c")
        self.status.configure(text=f"Saved {name}")

    def state(self) -> dict[str, Any]:
        return {"filename": self.name.get(), "text": self.text.get("1.0", "end-1c"), "saved": dict(self.saved)}


APPS = {"calculator": Calculator, "editor": Editor}


def widget_tree(root: tk.Misc) -> list[dict[str, Any]]:
    """Every mapped widget under ``root``: class, Tk path, text or value, screen box; depth-first order."""
    out: list[dict[str, Any]] = []
    focus = root.focus_get()

    def walk(w: tk.Misc, depth: int) -> None:
        for child in w.winfo_children():
            if not child.winfo_ismapped():
                continue
            item = {
                "class": child.winfo_class(),
                "name": str(child).rsplit(".", 1)[-1],
                "text": _widget_text(child),
                "box": [child.winfo_rootx(), child.winfo_rooty(), child.winfo_width(), child.winfo_height()],
                "depth": depth,
                "focus": child is focus,
            }
            out.append(item)
            walk(child, depth + 1)

    walk(root, 0)
    return out


def _widget_text(w: tk.Misc) -> str:
    if isinstance(w, tk.Text):
        return w.get("1.0", "end-1c")
    if isinstance(w, tk.Entry):
        return w.get()
    try:
        return str(w.cget("text"))
    except tk.TclError:
        return ""


def serve(kind: str, sock_path: str, init: dict[str, Any]) -> None:
    """Run app ``kind`` until its window closes, answering control requests on ``sock_path``."""
    root = tk.Tk(className=kind)
    root.geometry(f"{WIDTH}x{HEIGHT}+0+0")
    app = APPS[kind](root, init)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path + ".tmp")

    def handle(_fd: Any, _mask: Any) -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            try:
                req = json.loads(data or b"{}")
                root.update()  # deliver the X events the server has queued for us before answering
                if req.get("op") == "tree":
                    reply = {"ok": True, "title": root.title(), "widgets": widget_tree(root)}
                elif req.get("op") == "state":
                    reply = {"ok": True, "state": app.state()}
                else:
                    reply = {"ok": False, "error": f"unknown op {req.get('op')!r}"}
            except Exception as e:  # noqa: BLE001 - a bad request gets an answer, the app keeps running
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")

    server.listen(8)
    root.createfilehandler(server, tk.READABLE, handle)
    root.update()
    root.focus_force()
    # Renaming makes the socket appear only once the window is up: its existence means "ready".
    os.rename(sock_path + ".tmp", sock_path)
    root.mainloop()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
