-- Teams and the audit log: the audit log is read newest first by team (owners) or across
-- every team (admins), paged by entry id (UUIDv7, so in time order).

CREATE INDEX audit_log_team_id ON audit_log (team_id, id DESC);
CREATE INDEX audit_log_actor ON audit_log (actor_id, id DESC);
CREATE INDEX team_members_user ON team_members (user_id);
