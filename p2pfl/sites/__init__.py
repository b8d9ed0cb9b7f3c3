"""A site's standing federation (docs/design.md, "Site policy"): the site's own policy over
the runs proposed to it (:mod:`p2pfl.sites.policy`)."""
