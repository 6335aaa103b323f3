"""``six.moves.urllib``, which pytorch/examples' ``super_resolution`` imports (six is not
installed here); the trial writes its images where the script looks, so nothing is fetched."""
