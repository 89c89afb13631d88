"""Ray mechanics every role uses: placement groups and bundles, and the supervisor that
replaces actors that die. Below the roles: every role's group creates its actors through them."""
