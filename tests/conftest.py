"""Suite-wide settings."""

from hypothesis import settings

# Property tests check what an input does, not how fast: on a busy 2-core CI
# machine hypothesis's default 200 ms deadline per example fails at random.
settings.register_profile("gradwatch", deadline=None)
settings.load_profile("gradwatch")
