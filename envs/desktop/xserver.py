"""An Xvfb display per env, and input through XTEST (python-xlib) plus screenshots (mss) on it.

:class:`Xvfb` starts ``Xvfb -displayfd`` (the server picks a free display number and writes it to a pipe, so two
envs never race for one) without TCP. :class:`XInput` sends clicks, text and key combinations as XTEST fake input;
each call ends with a round trip to the server, so when it returns the server has delivered the events to the app.
"""

from __future__ import annotations

import os
import random
import select
import shutil
import socket
import subprocess
import tempfile
import time

from envs.errors import ActionError, EnvError

_KEY_ALIASES = {
    "ctrl": "Control_L",
    "control": "Control_L",
    "shift": "Shift_L",
    "alt": "Alt_L",
    "super": "Super_L",
    "enter": "Return",
    "return": "Return",
    "esc": "Escape",
    "escape": "Escape",
    "backspace": "BackSpace",
    "tab": "Tab",
    "delete": "Delete",
    "space": "space",
    "up": "Up",
    "down": "Down",
    "left": "Left",
    "right": "Right",
    "home": "Home",
    "end": "End",
    "pageup": "Prior",
    "pagedown": "Next",
}
_SPECIAL_CHARS = {"\n": 0xFF0D, "\t": 0xFF09}
BUTTONS = {"left": 1, "middle": 2, "right": 3}


class Xvfb:
    """One Xvfb server; :attr:`display` is ``":N"``. ``alive``/``exit_code`` tell whether it died."""

    def __init__(self, width: int = 640, height: int = 480, start_timeout_s: float = 15.0) -> None:
        if shutil.which("Xvfb") is None:
            raise EnvError("Xvfb not found: install Debian's xvfb (apt-get install -y xvfb)")
        self.width, self.height = width, height
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.display = ""

    def start(self, attempts: int = 5) -> str:
        """Start the server and wait until it accepts clients; returns the display name.

        The display number is drawn at random (not Xvfb's first free one): an X server in another mount namespace
        (a sandbox with a private /tmp) holds its abstract socket without a lock file we could see, and a server
        that loses that race exits at once; we then try another number.
        """
        errors = []
        for _ in range(attempts):
            number = random.randrange(100, 30000)
            if os.path.exists(f"/tmp/.X{number}-lock"):
                continue
            error = self._start_on(number)
            if error is None:
                self.display = f":{number}"
                return self.display
            errors.append(error)
        raise EnvError(f"Xvfb did not start after {attempts} attempts: {'; '.join(errors) or 'no free display'}")

    def _start_on(self, number: int) -> str | None:
        """Start on display ``number``; None when it accepts clients, else why not."""
        r, w = os.pipe()
        with tempfile.TemporaryFile() as log:
            try:
                self.proc = subprocess.Popen(
                    ["Xvfb", f":{number}", "-displayfd", str(w), "-screen", "0", f"{self.width}x{self.height}x24"]
                    + ["-nolisten", "tcp", "-noreset"],
                    pass_fds=(w,),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
                os.close(w)
                w = -1
                written = _read_line(r, self.start_timeout_s)
            finally:
                os.close(r)
                if w >= 0:
                    os.close(w)
            if written == str(number) and _accepts(number) and self.proc.poll() is None:
                return None
            code = self.proc.poll()
            self.stop()
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-1:]
            return f":{number} exit code {code} {tail}"

    @property
    def pid(self) -> int | None:
        """The server's PID (None before start)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The server's exit code once it died (negative: killed by that signal)."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self) -> None:
        """Terminate the server (kill after 5 s). Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class XInput:
    """XTEST input on one display: ``click``, ``type_text``, ``key``."""

    def __init__(self, display: str) -> None:
        from Xlib import display as xdisplay

        self.d = xdisplay.Display(display)
        if not self.d.has_extension("XTEST"):
            raise EnvError(f"the X server {display} has no XTEST extension")
        self.width = self.d.screen().width_in_pixels
        self.height = self.d.screen().height_in_pixels

    def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        """Move the pointer to (x, y) and click ``count`` times."""
        from Xlib import X
        from Xlib.ext import xtest

        if not (0 <= x < self.width and 0 <= y < self.height):
            raise ActionError(f"({x}, {y}) is outside the screen (0..{self.width - 1}, 0..{self.height - 1})")
        xtest.fake_input(self.d, X.MotionNotify, x=x, y=y)
        for _ in range(count):
            xtest.fake_input(self.d, X.ButtonPress, BUTTONS[button])
            xtest.fake_input(self.d, X.ButtonRelease, BUTTONS[button])
        self.d.sync()

    def type_text(self, text: str) -> None:
        """Type ``text`` key by key (Shift where the keymap needs it); unmappable characters are an error."""
        self.type_strokes(self.strokes(text))

    def strokes(self, text: str) -> list[tuple[int, bool]]:
        """The (keycode, shift) of each character of ``text``; an :class:`ActionError` names one it cannot type
        (checked for all before any is typed)."""
        return [self._stroke(c) for c in text]

    def type_strokes(self, strokes: list[tuple[int, bool]]) -> None:
        """Type ``strokes`` (from :meth:`strokes`) and wait until the server has delivered them."""
        for keycode, shift in strokes:
            self._tap(keycode, shift)
        self.d.sync()

    def key(self, combo: str) -> None:
        """Press a combination like ``ctrl+s``, ``Return`` or ``ctrl+shift+Home``."""
        from Xlib import XK, X
        from Xlib.ext import xtest

        names = [n.strip() for n in combo.split("+")]
        if not combo.strip() or any(not n for n in names):
            raise ActionError(f"bad key combination {combo!r}: use names joined by '+', e.g. ctrl+s or Return")
        codes = []
        for n in names:
            sym = XK.string_to_keysym(_KEY_ALIASES.get(n.lower(), n))
            code = self.d.keysym_to_keycode(sym) if sym else 0
            if not code:
                raise ActionError(f"unknown key {n!r} in {combo!r}")
            codes.append(code)
        for code in codes:
            xtest.fake_input(self.d, X.KeyPress, code)
        for code in reversed(codes):
            xtest.fake_input(self.d, X.KeyRelease, code)
        self.d.sync()

    def _stroke(self, ch: str) -> tuple[int, bool]:
        sym = _SPECIAL_CHARS.get(ch, ord(ch) if 0x20 <= ord(ch) <= 0xFF else 0x01000000 + ord(ch))
        code = self.d.keysym_to_keycode(sym)
        if not code:
            raise ActionError(f"cannot type {ch!r}: the keyboard has no key for it")
        return code, self.d.keycode_to_keysym(code, 0) != sym

    def _tap(self, keycode: int, shift: bool) -> None:
        from Xlib import XK, X
        from Xlib.ext import xtest

        shift_code = self.d.keysym_to_keycode(XK.string_to_keysym("Shift_L"))
        if shift:
            xtest.fake_input(self.d, X.KeyPress, shift_code)
        xtest.fake_input(self.d, X.KeyPress, keycode)
        xtest.fake_input(self.d, X.KeyRelease, keycode)
        if shift:
            xtest.fake_input(self.d, X.KeyRelease, shift_code)

    def close(self) -> None:
        """Close the connection (quietly when the server is gone)."""
        try:
            self.d.close()
        except Exception:  # noqa: BLE001 - the server may be dead already
            pass


def _read_line(fd: int, timeout_s: float) -> str:
    """Read up to a newline from ``fd``. Xvfb writes the number and the newline separately, and dies on EPIPE if
    the pipe is closed in between, so the whole line must be read before closing."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 32) if ready else b""
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _accepts(number: int) -> bool:
    """True when display ``number``'s Unix socket accepts a connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(f"/tmp/.X11-unix/X{number}")
        except OSError:
            return False
    return True


def screenshot_png(display: str, grabber: object | None = None) -> bytes:
    """A PNG of the whole screen of ``display`` (pass an ``mss`` instance to reuse its connection)."""
    import mss
    import mss.tools

    sct = grabber if grabber is not None else mss.MSS(display=display)
    try:
        shot = sct.grab(sct.monitors[0])  # type: ignore[attr-defined]
        return mss.tools.to_png(shot.rgb, shot.size) or b""
    finally:
        if grabber is None:
            sct.close()  # type: ignore[attr-defined]
