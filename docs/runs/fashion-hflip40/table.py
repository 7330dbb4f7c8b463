#!/usr/bin/env python3
"""Fashion-MNIST, the 40-epoch recipe of ../fashion-ema40 with --hflip (training images mirrored left-right), two
seeds (fashion-hflip-lane.sh): the same rows as ../fashion-ema40/table.py, read from this folder.   Usage: table.py"""
import os, subprocess, sys
here = os.path.dirname(os.path.abspath(__file__))
sys.exit(subprocess.call([sys.executable, os.path.join(here, "..", "fashion-ema40", "table.py"), here]))
