"""The two-phase coordinated checkpoint (Koo–Toueg style)."""
