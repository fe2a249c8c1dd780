cd /work/wt/guard
export PYTHONPATH=/work/wt/guard
python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 9 > /tmp/guard-ab/A1.txt 2>&1
PYTHONPATH=/tmp/guard-llamacpp-new:/work/wt/guard python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 9 > /tmp/guard-ab/B.txt 2>&1
python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 9 > /tmp/guard-ab/A2.txt 2>&1
