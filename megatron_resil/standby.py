"""`python -m megatron_resil.standby`: the standby's former name, kept for users' scripts. The standby is
megatron_resil/launch/standby.py; this runs its main() and holds no state of its own (a rank forked from
the standby finds the standby's module, and its record of the rank's client, where pretrain.py does)."""

import sys

if __name__ == "__main__":
    from megatron_resil.launch import standby

    sys.exit(standby.main())
