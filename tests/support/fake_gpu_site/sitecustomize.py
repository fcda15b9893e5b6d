"""Put the fake pycuda (tests/support/fake_pycuda.py) under every Python process started with DEEPDSL_FAKE_GPU=1 and this
folder on PYTHONPATH: `pytest --fake-gpu` does both, so generated programs run with `--device cuda` and benchmark
workers it starts reach the emulated GPU as the test process does."""
import os
import sys

if os.environ.get("DEEPDSL_FAKE_GPU") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    from tests.support.fake_pycuda import install_for_process

    install_for_process()
