-- Triggers: what starts or continues agents without a person at the keyboard. Webhooks
-- from GitHub or GitLab (verified with the trigger's secret, sealed like a team secret)
-- and schedules (cron). Each delivery or schedule slot is a run, recorded once: the
-- unique keys below are what makes a redelivery or a second replica do nothing.
CREATE TABLE triggers (
    id                uuid PRIMARY KEY,
    team_id           uuid NOT NULL REFERENCES teams(id),
    project_id        uuid NOT NULL REFERENCES projects(id),
    name              text NOT NULL,
    kind              text NOT NULL CHECK (kind IN ('github', 'gitlab', 'cron')),
    enabled           boolean NOT NULL DEFAULT true,
    -- What the trigger does (rules, schedule, agent settings), as validated at creation.
    spec              jsonb NOT NULL,
    -- Webhooks: the secret that signs (GitHub) or accompanies (GitLab) deliveries.
    secret_key_id     text,
    secret_nonce      bytea,
    secret_ciphertext bytea,
    -- Cron: the latest slot already considered (run, skipped or before creation).
    last_slot         timestamptz,
    -- Whom the trigger acts for.
    created_by        uuid NOT NULL REFERENCES users(id),
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX triggers_team ON triggers (team_id, id);
CREATE INDEX triggers_cron ON triggers (id) WHERE kind = 'cron' AND enabled;

CREATE TABLE trigger_runs (
    id            uuid PRIMARY KEY,
    trigger_id    uuid NOT NULL REFERENCES triggers(id) ON DELETE CASCADE,
    -- A webhook delivery's id, or the schedule slot a cron run is for.
    delivery_id   text,
    slot          timestamptz,
    -- What arrived: the forge's event name, or `schedule`.
    event         text NOT NULL,
    outcome       text NOT NULL
        CHECK (outcome IN ('started_agent', 'sent_message', 'queued', 'ignored', 'failed')),
    reason        text,
    agent_id      uuid,
    workspace_id  uuid,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (trigger_id, delivery_id),
    UNIQUE (trigger_id, slot)
);
CREATE INDEX trigger_runs_newest ON trigger_runs (trigger_id, id DESC);
