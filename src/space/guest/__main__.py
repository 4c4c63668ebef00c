"""`python3 -m space.guest`: run spaced on this process's stdin/stdout."""

from space.guest.daemon import main

raise SystemExit(main())
