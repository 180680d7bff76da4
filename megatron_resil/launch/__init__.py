"""Starting ranks: the standby that ranks are forked from with torch (and megatron-core) already imported
(standby.py; standby_wire.py its messages, standby_settings.py what a forked rank keeps of its own start,
standby_warmup.py megatron-core imported ahead), and NVRx's ft_launcher with torch's keep-alive keys
(ft_launcher.py). Run them as `python -m megatron_resil.launch.standby` and `python -m
megatron_resil.launch.ft_launcher` (the older names, `megatron_resil.standby` and
`megatron_resil.ft_launcher`, still work). Importing this package imports none of them: pretrain.py's
first lines import standby.py.
"""
