"""Profiles estimated from counted FLOPs and bytes on a device sheet, and sheets calibrated here.

    op_counts.py   OpCounter, CountingTimer: every op counted, its time on the sheet's roofline
    estimate.py    estimate(): profile(estimate=)'s rows, loss, metadata and corrections
    calibrate.py   calibrate(): this device measured into a sheet, efficiencies and launch fitted
"""
