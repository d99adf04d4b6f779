-- Teams cannot be captured; sign-in is bound to the browser that started it.
--
-- A team that `[auth.oidc.groups]` maps to is bound to the mapping by a key the server
-- records when it creates the team (`oidc:<issuer>#<team>`), never adopted by name: a
-- team people made themselves has no key and never gets one. Teams the server made for a
-- mapping before this migration (no `team.create` entry in the audit log, which every
-- team made through the API has) are marked `legacy:<name>`: the first sign-in whose
-- mapping names that team binds it to the mapping's key, once.
ALTER TABLE teams ADD COLUMN idp_key text UNIQUE;
UPDATE teams t SET idp_key = 'legacy:' || t.name
WHERE t.name <> 'default'
  AND NOT EXISTS (
      SELECT 1 FROM audit_log a WHERE a.team_id = t.id AND a.action = 'team.create'
  );

-- A person's default team (where new resources go when a request names none) is their
-- own choice; without one, their oldest membership. Being added to a team never changes
-- it.
ALTER TABLE users ADD COLUMN default_team_id uuid REFERENCES teams(id) ON DELETE SET NULL;

-- Whether the user's email is one the identity provider verified. Local users' emails
-- are set by a server admin. Only verified addresses are used to find people.
ALTER TABLE users ADD COLUMN email_verified boolean NOT NULL DEFAULT true;

-- A sign-in in progress is bound to the browser that started it: the hash of a random
-- pre-login cookie is kept with the state, and the callback must bring the cookie.
-- Sign-ins started before this migration cannot be finished.
DELETE FROM oidc_logins;
ALTER TABLE oidc_logins
    ADD COLUMN browser_hash bytea NOT NULL,
    ADD COLUMN client_addr text NOT NULL DEFAULT '',
    ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX oidc_logins_client ON oidc_logins (client_addr, created_at);
CREATE INDEX oidc_logins_expiry ON oidc_logins (expires_at);
