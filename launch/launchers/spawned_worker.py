"""Imported first by ``launch/train.py``: a training process the local launcher spawned ends
quietly on SIGINT (the system's default, no KeyboardInterrupt) until its stop handlers are in
place (``launch.run.stop``).

torch elastic starts the local workers with multiprocessing's "spawn": each new interpreter
first imports ``launch/train.py`` as ``__mp_main__``, then torch, for seconds. A terminal's Ctrl-C
reaches every process of the group, and torch elastic passes the SIGINT it gets on to its
workers: in a worker still importing, Python's default would raise KeyboardInterrupt there,
a traceback on the console. Nothing was trained yet, so the worker just exits.
"""

import signal
import sys

if "__mp_main__" in sys.modules:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
