package dburl

import "testing"

func TestRedact(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:secret@db:5432/x":               "postgres://u:xxxxx@db:5432/x",
		"postgres://u@/x?host=%2Ftmp&password=secret": "postgres://u@/x?host=%2Ftmp&password=xxxxx",
		"postgresql://db/x":                           "postgresql://db/x",
		"postgres://u:p@[::1:5432/x":                  "(an unparsable URL)",
	} {
		if got := Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
	if !IsPostgres("postgresql://x") || !IsPostgres("postgres://x") || IsPostgres("/var/lib/store.db") || IsPostgres("mysql://x") {
		t.Error("IsPostgres")
	}
}
