"""The precision doctor: which layer breaks in 16 bits, how far each gradient drifts, and what to
change (doctor/diagnosis.py); what a run weighs (doctor/memory.py)."""
