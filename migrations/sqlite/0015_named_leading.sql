-- Performance (issue 16): a turn with no session that names the request holding its first
-- messages (0014) still stored its leading messages (a Responses turn's instructions, sent
-- with every call of the Agents SDK's loop) whole, each turn. A request holding its
-- transcript whole keeps their digest beside them (`leadingDigest`), and a turn naming it
-- names them too when its own have that digest, keeping the digest in turn. The column
-- repeats that member for the requests the lookup finds, and the lookup's index holds it,
-- so the lookup still reads no input.
ALTER TABLE requests ADD COLUMN leading_digest TEXT;
-- Built again with the column: the build reads each row's columns once, as 0014's did.
DROP INDEX requests_by_input_digest;
CREATE INDEX requests_by_input_digest
    ON requests(input_digest, owner, agent_id, id, updated_at, prefix_of, prefix_len,
                leading_digest)
    WHERE input_digest IS NOT NULL;
