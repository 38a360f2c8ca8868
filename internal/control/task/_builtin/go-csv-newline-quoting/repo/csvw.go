// Package csvw writes records in the CSV format described by RFC 4180.
package csvw

import (
	"io"
	"strings"
)

// Writer writes CSV records to an underlying io.Writer.
type Writer struct {
	Comma   rune // field delimiter, ',' by default
	UseCRLF bool // end records with \r\n instead of \n

	w io.Writer
}

// NewWriter returns a Writer that writes to w.
func NewWriter(w io.Writer) *Writer {
	return &Writer{Comma: ',', w: w}
}

// fieldNeedsQuotes reports whether field must be enclosed in double quotes
// so that a reader gets it back unchanged.
func (w *Writer) fieldNeedsQuotes(field string) bool {
	if field == "" {
		return false
	}
	if field[0] == ' ' || field[0] == '\t' {
		return true
	}
	return strings.ContainsRune(field, w.Comma) || strings.ContainsRune(field, '"')
}

// Write writes a single record.
func (w *Writer) Write(record []string) error {
	var b strings.Builder
	for i, field := range record {
		if i > 0 {
			b.WriteRune(w.Comma)
		}
		if !w.fieldNeedsQuotes(field) {
			b.WriteString(field)
			continue
		}
		b.WriteByte('"')
		b.WriteString(strings.ReplaceAll(field, `"`, `""`))
		b.WriteByte('"')
	}
	if w.UseCRLF {
		b.WriteString("\r\n")
	} else {
		b.WriteByte('\n')
	}
	_, err := io.WriteString(w.w, b.String())
	return err
}

// WriteAll writes all records, stopping at the first error.
func (w *Writer) WriteAll(records [][]string) error {
	for _, r := range records {
		if err := w.Write(r); err != nil {
			return err
		}
	}
	return nil
}
