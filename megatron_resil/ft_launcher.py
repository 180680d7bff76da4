"""`python -m megatron_resil.ft_launcher`: the former name of megatron_resil/launch/ft_launcher.py, kept for
users' scripts; this runs its main()."""

import sys

if __name__ == "__main__":
    from megatron_resil.launch import ft_launcher

    sys.exit(ft_launcher.main())
