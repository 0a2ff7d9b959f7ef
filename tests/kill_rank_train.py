"""torchrun entry of tests/test_distributed_cli.py: ``python -m model.train``, except that on the
first launch (TORCHELASTIC_RESTART_COUNT 0) rank KILL_RANK SIGKILLs itself as it starts writing
checkpoint number KILL_AT_SAVE, so that the other rank has written its part: a torn checkpoint."""

import faulthandler
import os
import signal
import sys

import torch.distributed.checkpoint as dcp

from model import train

_real_save = dcp.save
_saves = 0


def _save(*args, **kwargs):
    global _saves
    _saves += 1
    if (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ["RANK"] == os.environ["KILL_RANK"]
            and _saves == int(os.environ["KILL_AT_SAVE"])):
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_save(*args, **kwargs)


dcp.save = _save

if __name__ == "__main__":
    # A hung relaunch prints where it hangs and exits, instead of blocking until gloo's timeout.
    faulthandler.dump_traceback_later(int(os.environ.get("HANG_DUMP_S", "120")), exit=True, file=sys.stderr)
    train.main()
