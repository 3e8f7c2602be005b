"""Run examples/finetune_hf.py with the export corrupted where hf.save_pretrained builds the state
it writes (rank 0; the trained model and the DCP checkpoint untouched): four rows of the head
scaled by 0.97, a stale shard's worth of error. tests/test_examples.py checks the example's
export check reports it.

    torchrun ... tests/_export_bug.py examples/finetune_hf.py [its flags]
"""

import runpy
import sys

import parallel_layers.hf as hf

_checked = hf._checked


def _corrupted(state, plain):
    state = dict(_checked(state, plain))
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][:4] *= 0.97
    return state


hf._checked = _corrupted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
