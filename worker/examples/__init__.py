"""Example entrypoints for `python -m worker --entrypoint worker.examples.<name>:task`.

digits (scikit-learn 8x8 digits, no download), mnist, reuters, images (MobileNetV2 on a
folder). Data paths come from the function's `data=` argument or the MGPU_DATA variable.
"""
