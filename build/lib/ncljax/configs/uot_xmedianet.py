r"""UOT-RCL on XMediaNet (200 classes, 32,000 training pairs): ``configs/uot_rcl.py:xmedianet``.

  python train.py --config=configs/uot_xmedianet.py --workdir=runs/uot_xmedianet
  python train.py --config=configs/uot_xmedianet.py:quick --config.noise.rate=0.8

Kept under this name because the design card's example command uses it; every setting
is ``configs/uot_rcl.py``'s (its docstring lists them), the argument is passed on.
"""

import os

from ncljax import config as config_lib

DATASETS = ("xmedianet",)


def get_config(arg: str = ""):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "uot_rcl.py")
    options = [w for w in arg.split(",") if w and w != "xmedianet"]
    return config_lib.load_file(path, ",".join(["xmedianet", *options]))
