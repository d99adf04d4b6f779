-- An agent's row is rewritten often: its lease every few seconds, its status and last
-- turn at each turn's start and end. With full pages, each rewrite went to another page
-- and added an entry to every index of the table (the labels' GIN index too), and the
-- statements that do it hold the row's lock meanwhile. Room left on each page lets
-- PostgreSQL keep a new version on its page without touching the indexes (none of the
-- columns rewritten is indexed). Rows already stored move as they are next rewritten.
ALTER TABLE agents SET (fillfactor = 50);
