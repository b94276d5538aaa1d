"""`python -m blockspec.demo`: the GSM8K demo (what `make demo` runs)."""
from blockspec.demo.gsm8k_demo import main

main()
