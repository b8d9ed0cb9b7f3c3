"""Privacy's pure maths, on the ground floor: DP-SGD's accountant (``accountant``), the
update-level mechanism and its accountant (``update_dp``, ``update_accountant``), the noise
spread the ``clip`` defence allows (``noise_spread``), an accountant's checked history
(``history_state``), and SecAgg+ (``secagg``). The node's use of them is in
:mod:`p2pfl.services`."""
