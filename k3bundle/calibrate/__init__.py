"""Calibration: every check of ``validate`` measured on clean and faulted bundles of a device.

``k3bundle calibrate`` (and ``bench/calibrate.py`` for the committed runs) synthesises
checkpoints, converts them, makes goldens, and judges the clean bundle and a catalogue of
planted faults on the device (and kernel backend) under calibration. Its records give each
check's clean worst and the least severe fault located there; a tolerance file carries them in
its ``calibration`` section, with the rates (docs/validation.md "Calibration").

- ``bundle_edits``: one device tensor of a bundle read or rewritten in place;
- ``faults``: the fault catalogue, by name: bundle faults (``weight_faults``) and faults of the
  device side of a run (``device_faults``), each stating where it was planted (``planted``);
- ``jobs``: one (preset, seed, layout, device) job and the run of many, appending records;
- ``records``: what a judged case leaves in a record, and reading records back;
- ``tables``: separation, rates and limits derived from records;
- ``tolerance_file``: the calibrated tolerance file (``tolerance_for``: a layout's shipped one);
- ``run``: ``k3bundle calibrate``: inputs checked, jobs run, the tolerance file written.
"""
