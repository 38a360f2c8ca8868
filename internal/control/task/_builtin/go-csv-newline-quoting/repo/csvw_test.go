package csvw

import (
	"encoding/csv"
	"reflect"
	"strings"
	"testing"
)

func write(t *testing.T, w *Writer, b *strings.Builder, records ...[]string) string {
	t.Helper()
	if err := w.WriteAll(records); err != nil {
		t.Fatalf("WriteAll: %v", err)
	}
	return b.String()
}

func TestPlainFields(t *testing.T) {
	var b strings.Builder
	got := write(t, NewWriter(&b), &b, []string{"a", "b", "c"}, []string{"1", "2", "3"})
	if want := "a,b,c\n1,2,3\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestEmbeddedQuoteAndComma(t *testing.T) {
	var b strings.Builder
	got := write(t, NewWriter(&b), &b, []string{`say "hi"`, "x,y", ""})
	if want := "\"say \"\"hi\"\"\",\"x,y\",\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestCustomCommaAndCRLF(t *testing.T) {
	var b strings.Builder
	w := NewWriter(&b)
	w.Comma = ';'
	w.UseCRLF = true
	got := write(t, w, &b, []string{"a;b", "c,d", " lead"})
	if want := "\"a;b\";c,d;\" lead\"\r\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestFieldWithNewline(t *testing.T) {
	var b strings.Builder
	got := write(t, NewWriter(&b), &b, []string{"id", "line one\nline two"})
	if want := "id,\"line one\nline two\"\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestRoundTripMultiline(t *testing.T) {
	records := [][]string{
		{"name", "address"},
		{"Ada", "12 Analytical Row\nLondon"},
		{"Bob", "carriage\rreturn"},
	}
	var b strings.Builder
	write(t, NewWriter(&b), &b, records...)
	got, err := csv.NewReader(strings.NewReader(b.String())).ReadAll()
	if err != nil {
		t.Fatalf("reading back %q: %v", b.String(), err)
	}
	if !reflect.DeepEqual(got, records) {
		t.Errorf("round trip mismatch:\n got %q\nwant %q", got, records)
	}
}
