"""Fleet mode: several llamaswap servers sharing PostgreSQL (the record) and Redis (presence
and live state). See docs/fleet.md."""
