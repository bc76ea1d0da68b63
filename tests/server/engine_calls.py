"""Functions the engine-process tests hand to the engine's own process (``EngineLoop.call`` /
``EngineProcess``'s build): importable by name, as anything crossing the socket must be."""
import os


def pid(engine) -> int:
    return os.getpid()


def frozen(engine) -> int:
    import gc

    return gc.get_freeze_count()


def fail_next_step(engine) -> None:
    engine.fail_next_step(RuntimeError("injected step failure"))


def fail_to_load(message: str):
    raise ValueError(message)


def exit_while_loading(code: int):
    os._exit(code)


def load_slowly(seconds: float):
    import time

    time.sleep(seconds)
    raise ValueError("loaded too slowly")


ORPHAN = """
import multiprocessing, os, sys, threading, time, functools
from jaxserve.server.engine_process import EngineProcess
from tests.server import engine_calls
threading.Thread(target=lambda: EngineProcess(functools.partial(engine_calls.load_slowly, 60)), daemon=True).start()
while not multiprocessing.active_children():
    time.sleep(0.05)
print(multiprocessing.active_children()[0].pid, flush=True)
os._exit(0)
"""
