"""SigV4 signing against AWS's published S3 example (GET Object, "Example: GET Object" in
the S3 API reference, sig-v4-header-based-auth): a wrong byte anywhere changes the signature."""

import datetime as dt

from gateway.cluster.objstore import EMPTY_SHA256, Credentials, sign

AWS = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = dt.datetime(2013, 5, 24, tzinfo=dt.UTC)


def test_aws_get_object_example():
    headers = sign("GET", "https://examplebucket.s3.amazonaws.com/test.txt",
                   {"Range": "bytes=0-9"}, EMPTY_SHA256, AWS, WHEN)
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    assert headers["x-amz-date"] == "20130524T000000Z"


def test_aws_put_object_example():
    # "Example: PUT Object": a key with a '$' (percent-encoded in the canonical URI) and
    # the body "Welcome to Amazon S3." signed by its SHA256.
    body_sha = "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
    headers = sign("PUT", "https://examplebucket.s3.amazonaws.com/test%24file.text",
                   {"Date": "Fri, 24 May 2013 00:00:00 GMT",
                    "x-amz-storage-class": "REDUCED_REDUNDANCY"}, body_sha, AWS, WHEN)
    assert headers["Authorization"].endswith(
        "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd")


def test_secret_key_changes_signature_and_is_not_in_repr():
    other = Credentials(AWS.access_key, AWS.secret_key + "x")
    a = sign("GET", "http://h/b/k", {}, EMPTY_SHA256, AWS, WHEN)["Authorization"]
    b = sign("GET", "http://h/b/k", {}, EMPTY_SHA256, other, WHEN)["Authorization"]
    assert a != b
    assert AWS.secret_key not in repr(AWS)
