"""What a unit costs: the hardware profile, time, bytes, collectives."""
