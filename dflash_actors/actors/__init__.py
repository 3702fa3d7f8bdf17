"""The four stages of the job, one module per actor kind, each with its contract on top:
``loader`` (batches into slots), ``target`` (the frozen target's features), ``drafter``
(the drafter's gradient) and ``optimizer`` (the step, the weights, checkpoints); the
lifecycle they share is the runtime's (``runtime.actor``).

Importing this package (every actor process does, to unpickle its entry point) makes
two process-wide choices that keep killed actors from leaving anything behind or
cluttering the terminal:
  * tqdm's lock becomes a thread lock: its default is a multiprocessing semaphore, made
    by every tqdm() (even a disabled one), that a SIGKILLed actor leaves in /dev/shm;
  * Hugging Face progress bars are off (the supervisor's status.json reports progress),
    unless the user set HF_HUB_DISABLE_PROGRESS_BARS themselves.
"""

import os
import threading

from tqdm import tqdm

tqdm.set_lock(threading.RLock())
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
