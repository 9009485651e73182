"""``agentflow/Desktop-v0``: Tk apps on the env's own Xvfb display, driven through XTEST.

Observation: the app's widget tree as text (class, name, text or value, and the screen centre to click) followed by
the task, plus a PNG screenshot of the display in the info's ``"images"``. The task closes every observation, as a
goal restated each step does in web-agent benchmarks: the agent reads the numbers and words it must enter next to
where it acts, not past a screenful of widgets (whose coordinates are numbers too). With ``observation="changes"``
only the episode's first screen (and a screen whose window changed) is the whole tree; after it, an observation
lists the widgets whose line changed since the last one (new text, focus, position) and those that went away: an
agent that keeps its history needs nothing more, and a calculator episode is ~680 tokens instead of ~1,300. Tools:
``click(x, y, button, double)``, ``type_text(text)``, ``key(combo)``. Answering ends the episode; the verifier reads
the app's state over its control socket. Each episode starts the task's app afresh (awaited, so a starting app holds
no thread). A dead X server or app raises :class:`~envs.errors.EnvCrashedError`; the next reset starts a new X
server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Literal

from envs.core import ToolSpec
from envs.desktop.tasks import TASK_TYPES, DesktopTask, check_state, make_task
from envs.desktop.xserver import BUTTONS, XInput, Xvfb, screenshot_png
from envs.errors import ActionError, EnvCrashedError, EnvError
from envs.screen import LoopThread, ScreenEnv
from envs.tasks import DEFAULT_TASK_SET, lookup_task_set, simple_task_set

APP_START_TIMEOUT_S = 20.0
OBSERVATIONS = ("tree", "changes")
"""What each observation shows: the whole widget tree, or after the first screen only the widgets that changed."""
TYPE_CHUNK = 32
"""Characters typed between two yields to the backend loop."""
SYSTEM_PROMPT = (
    "You operate a desktop app on a 640x480 screen to complete a task. Each observation lists the app's widgets "
    "with their screen centres; click at coordinates, type text into the focused widget, or press key "
    "combinations like ctrl+s. When the task is complete, answer 'done'."
)
TOOLS = [
    ToolSpec(
        "click",
        "Click at screen coordinates.",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer"},
                "y": {"type": "integer"},
                "button": {"type": "string", "enum": list(BUTTONS), "default": "left"},
                "double": {"type": "boolean", "default": False},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "type_text",
        "Type text with the keyboard into the focused widget (newlines press Return).",
        {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "key",
        "Press a key or combination, e.g. Return, ctrl+s, ctrl+End, BackSpace.",
        {
            "type": "object",
            "properties": {"combo": {"type": "string"}},
            "required": ["combo"],
            "additionalProperties": False,
        },
    ),
]


class DesktopEnv(ScreenEnv):
    """Desktop tasks (:data:`~envs.desktop.tasks.TASK_TYPES`) on a private Xvfb; one app process per episode."""

    branching = "replay"  # a fresh app process per episode, its content from the seed

    tools = TOOLS
    system_prompt = SYSTEM_PROMPT
    max_turns = 12
    task_sets = {"default": simple_task_set(task_types=TASK_TYPES, description="calculator and text-editor tasks")}
    max_observation_chars = 8192

    def __init__(
        self,
        max_turns: int | None = None,
        split: str = "train",
        task_set: str = DEFAULT_TASK_SET,
        observation: Literal["tree", "changes"] = "tree",
    ) -> None:
        super().__init__(max_turns=max_turns)
        lookup_task_set(self.task_sets, task_set, type(self).__name__).seed_range(split)  # validates both
        if observation not in OBSERVATIONS:
            raise ValueError(f"unknown Desktop-v0 observation {observation!r}; expected one of {OBSERVATIONS}")
        self.split, self.task_set, self.observation = split, task_set, observation
        self._shown: tuple[str, Widgets] | None = None
        """The window title and widget lines the agent saw last (``changes`` reports against them)."""
        self.xvfb = Xvfb()
        self.x_restarts = 0
        self.task: DesktopTask | None = None
        self.last_observation = ""
        self._loop = LoopThread("agentflow-desktop")
        self._input: XInput | None = None
        self._grabber: Any = None
        self._app: asyncio.subprocess.Process | None = None
        self._tmp = tempfile.mkdtemp(prefix="agentflow-desktop-")  # removed by close (at exit too: envs.screen)
        self._sock = ""
        self._checks: dict[str, bool] = {}
        self._episodes = 0
        self._closed = False

    @property
    def backend(self) -> LoopThread:
        """This env's own loop."""
        return self._loop

    # -- episode -----------------------------------------------------------------------------------------------
    async def areset_task(self, seed: int, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Draw the task, make sure the X server lives (a new one if it died) and start the task's app."""
        info = self.draw_task(seed, options, make_task)
        await self._stop_app()
        await self._ensure_x()
        await self._start_app(self.task)
        self._shown = None  # the first screen of an episode is always the whole tree
        return await self._observe(), info

    async def atool(self, name: str, arguments: dict[str, Any]) -> str:
        """Send the input through XTEST, then observe."""
        if self._input is None or self._app is None:
            raise EnvError("no app: call reset() first")
        self._raise_if_crashed(None)
        try:
            if name == "click":
                count = 2 if arguments.get("double") else 1
                self._input.click(arguments["x"], arguments["y"], arguments.get("button", "left"), count)
            elif name == "type_text":
                await self._type(arguments["text"])
            else:
                self._input.key(arguments["combo"])
        except ActionError:
            raise
        except Exception as e:  # noqa: BLE001 - an X error: a dead server or a real failure
            self._raise_if_crashed(e)
            raise EnvError(f"{name} failed: {e}") from e
        return await self._observe()

    async def _type(self, text: str) -> None:
        """Type in chunks, yielding to the loop between them: a long text can be stopped (``action_timeout_s``)
        and never blocks the loop that resets, scores and closes the env."""
        assert self._input is not None
        strokes = self._input.strokes(text)
        for i in range(0, len(strokes), TYPE_CHUNK):
            self._input.type_strokes(strokes[i : i + TYPE_CHUNK])
            await asyncio.sleep(0)

    async def ascore(self, text: str) -> tuple[float, bool]:
        """1.0 when the app's state meets every goal condition."""
        if self.task is None:
            raise EnvError("no task: call reset() first")
        state = await self._request({"op": "state"})
        self._checks = check_state(self.task, state["state"])
        ok = all(self._checks.values())
        return (1.0 if ok else 0.0), ok

    def answer_info(self) -> dict[str, Any]:
        """Which goal conditions held."""
        return {"checks": dict(self._checks)}

    # -- backend -----------------------------------------------------------------------------------------------
    async def _ensure_x(self) -> None:
        if self.xvfb.alive and self._input is not None:
            return
        if self.xvfb.proc is not None:  # it died: forget its connections and start another
            self.x_restarts += 1
        self._drop_x_clients()
        self.xvfb.stop()
        await asyncio.to_thread(self.xvfb.start)
        self._input = XInput(self.xvfb.display)
        import mss

        self._grabber = mss.MSS(display=self.xvfb.display)

    def _drop_x_clients(self) -> None:
        if self._input is not None:
            self._input.close()
            self._input = None
        if self._grabber is not None:
            try:
                self._grabber.close()
            except Exception:  # noqa: BLE001 - its server may be gone
                pass
            self._grabber = None

    async def _start_app(self, task: DesktopTask) -> None:
        self._episodes += 1
        self._sock = os.path.join(self._tmp, f"app{self._episodes}.sock")
        env = {**os.environ, "DISPLAY": self.xvfb.display}
        argv = [sys.executable, "-m", "envs.desktop.apps", task.app, self._sock, json.dumps(task.init)]
        self._app = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        deadline = asyncio.get_running_loop().time() + APP_START_TIMEOUT_S
        while not os.path.exists(self._sock):
            if self._app.returncode is not None or asyncio.get_running_loop().time() > deadline:
                err = b""
                if self._app.returncode is not None and self._app.stderr is not None:
                    err = await self._app.stderr.read()
                await self._stop_app()
                raise EnvError(f"the {task.app} app did not start: {err.decode(errors='replace')[-500:].strip()}")
            await asyncio.sleep(0.02)

    async def _stop_app(self) -> None:
        app, self._app = self._app, None
        if app is None or app.returncode is not None:
            return
        try:
            app.terminate()
        except ProcessLookupError:  # killed already (recover_backend); wait() reaps it
            pass
        try:
            await asyncio.wait_for(app.wait(), 5)
        except TimeoutError:
            app.kill()
            await app.wait()

    async def _request(self, req: dict[str, Any]) -> dict[str, Any]:
        """One control request to the app (its reply reflects every X event delivered so far)."""
        self._raise_if_crashed(None)
        try:
            reader, writer = await asyncio.open_unix_connection(self._sock)
            writer.write(json.dumps(req).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 10)
            writer.close()
        except (OSError, TimeoutError) as e:
            self._raise_if_crashed(e)
            raise EnvError(f"the app did not answer {req['op']!r}: {e}") from e
        reply = json.loads(line or b"{}")
        if not reply.get("ok"):
            self._raise_if_crashed(None)
            raise EnvError(f"the app refused {req['op']!r}: {reply.get('error', 'no reply')}")
        return reply

    async def _observe(self) -> str:
        tree = await self._request({"op": "tree"})
        try:
            self.add_image(await asyncio.to_thread(screenshot_png, self.xvfb.display, self._grabber))
        except Exception as e:  # noqa: BLE001 - a grab failing on a dead server
            self._raise_if_crashed(e)
            raise EnvError(f"screenshot failed: {e}") from e
        title = str(tree["title"])
        widgets = [(widget_head(w), widget_line(w)) for w in tree["widgets"]]
        self.last_observation = "\n".join([f"Window: {title}", *(line for _, line in widgets)])  # the whole tree
        shown = self.last_observation
        if self.observation == "changes" and self._shown is not None and self._shown[0] == title:
            shown = changes_text(title, self._shown[1], widgets)
        self._shown = (title, widgets)
        task = f"\nTask: {self.task.prompt}" if self.task is not None else ""
        return shown + task

    def _raise_if_crashed(self, cause: BaseException | None) -> None:
        if self.xvfb.proc is not None and not self.xvfb.alive:
            reason = f"the X server {self.xvfb.display} (pid {self.xvfb.pid}) exited with code {self.xvfb.exit_code}"
            raise EnvCrashedError(reason) from cause
        if self._app is not None and self._app.returncode is not None:
            name = self.task.app if self.task else "app"
            raise EnvCrashedError(f"the {name} app exited with code {self._app.returncode}") from cause

    def recover_backend(self) -> None:
        """A loop that stopped answering: kill the app and the X server (a call blocked on them returns), stop
        the old loop, start a new one; the reset then starts a new X server and app."""
        self._kill_processes()
        self._stop_loop()
        self._drop_x_clients()
        self.xvfb.stop()
        self._loop = LoopThread("agentflow-desktop")

    def _kill_processes(self) -> None:
        app = self._app
        if app is not None and app.returncode is None:
            try:
                os.kill(app.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.xvfb.alive and self._wedged is not None:
            self.xvfb.stop()

    def _stop_loop(self) -> None:
        """Reap the app on its loop (so its transport closes there), then stop and close the loop."""
        if not self._loop.alive:
            return
        try:
            self._loop.run(self._stop_app(), 2 if self._wedged else 10)
        except Exception:  # noqa: BLE001 - a loop that does not answer: its processes were killed already
            self._kill_processes()
        self._loop.stop(timeout=5)

    def close(self) -> None:
        """Stop the app, the X server and the loop. Safe to call twice, and after a backend that stopped answering."""
        if self._closed:
            return
        self._closed = True
        if self._wedged is not None:
            self._kill_processes()
        self._stop_loop()
        self._app = None
        self._drop_x_clients()
        self.xvfb.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)
        super().close()


Widgets = list[tuple[str, str]]
"""A screen's widgets in tree order, each as (:func:`widget_head`, :func:`widget_line`)."""


def widget_head(w: dict[str, Any]) -> str:
    """What identifies a widget from one screen to the next: its indent (depth), class and name."""
    return f'{"  " * w["depth"]}- {w["class"]} "{w["name"]}"'


def widget_line(w: dict[str, Any]) -> str:
    """One widget of the app's tree as the agent reads it: class, name, text, the centre to click, focus."""
    x, y, width, height = w["box"]
    text = f" {json.dumps(w['text'], ensure_ascii=False)}" if w["text"] else ""
    focus = " [focused]" if w["focus"] else ""
    return f"{widget_head(w)}{text} center ({x + width // 2}, {y + height // 2}){focus}"


def changes_text(title: str, before: Widgets, after: Widgets) -> str:
    """What changed between two screens of the same window: widgets whose line is new or different, in tree
    order, then those no longer there (by head, marked ``[gone]``)."""
    old = {line for _, line in before}
    changed = [line for _, line in after if line not in old]
    heads_now = {head for head, _ in after}
    gone = [f"{head} [gone]" for head, _ in before if head not in heads_now]
    if not changed and not gone:
        return f"Window: {title} (no change)"
    return "\n".join([f"Window: {title} (changed widgets; the rest as before)", *changed, *gone])
