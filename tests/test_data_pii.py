from collections import Counter

import pytest

from llmstack.data.document import Document
from llmstack.data.pii import mask_pii, pii


@pytest.mark.parametrize(
    "text",
    [
        "write to john.doe+news@mail.example.co.uk today",
        "or Jane_D@example.org.",
    ],
)
def test_emails_are_masked(text):
    masked, found = mask_pii(text)
    assert "@" not in masked and "<EMAIL>" in masked and found == Counter(emails=1)


@pytest.mark.parametrize("address", ["8.8.8.8", "151.101.1.69", "2001:4860:4860::8888", "2606:4700:4700::1111"])
def test_public_ip_addresses_are_masked(address):
    masked, found = mask_pii(f"the server {address} was down")
    assert masked == "the server <IP_ADDRESS> was down" and found == Counter(ip_addresses=1)


@pytest.mark.parametrize(
    "text",
    [
        "the router 192.168.0.1 and 10.0.0.7 and 127.0.0.1 and ::1 and fe80::1 stay",
        "at 12:30:45 on 2023-01-15 the time was noted",
        "version 3.11.7 and 1.2.3 are versions",
    ],
)
def test_private_addresses_times_and_versions_are_kept(text):
    assert mask_pii(text) == (text, Counter())


@pytest.mark.parametrize(
    "phone",
    ["+1 (555) 123-4567", "555-123-4567", "+44 20 7946 0958", "030 1234 5678", "(02) 9876 5432", "+49 30 901820"],
)
def test_phone_numbers_are_masked(phone):
    masked, found = mask_pii(f"Call {phone} now.")
    assert masked == "Call <PHONE> now." and found == Counter(phone_numbers=1)


@pytest.mark.parametrize(
    "text",
    [
        "ISBN 978-0-306-40615-7 is a book",
        "ISBN-10: 0-306-40615-2 is a book",
        "ISBN 0306 4061 52 is a book",  # a valid ISBN-10 even without the label nearby
        "see 978 0306 4061 57 for the book",  # valid ISBN-13 checksum
        "doi:10.1000/182 and https://doi.org/10.1038/nphys1170 are papers",
        "DOI 10.1093/ajae/aaq063 is a paper",
        "arXiv:2101.00027 is a preprint",
        "the date 2023-01-15 and 15.01.2023",
        "it costs 1 234 dollars",
    ],
)
def test_isbn_doi_dates_and_small_numbers_are_not_phone_numbers(text):
    assert mask_pii(text) == (text, Counter())


def test_pii_stage_rewrites_the_document_and_counts():
    doc, counts = Document("mail a@b.com or 8.8.8.8 or b@c.org, phone 555-123-4567"), Counter()
    assert pii(doc, counts) is None
    assert doc.text == "mail <EMAIL> or <IP_ADDRESS> or <EMAIL>, phone <PHONE>"
    assert counts == Counter(emails=2, ip_addresses=1, phone_numbers=1)
    assert pii(Document("x@y.io"), Counter(), email="[email]") is None


def test_custom_replacements():
    assert mask_pii("x@y.io 8.8.8.8", email="[e]", ip="[ip]")[0] == "[e] [ip]"


@pytest.mark.parametrize(
    "text, masked",
    [
        ("请拨打13812345678联系我", "请拨打<PHONE>联系我"),
        ("手机：+86 138-1234-5678。", "手机：<PHONE>。"),
        ("电话 0086 159 1234 5678 或邮箱zhang.san@example.com谢谢", "电话 <PHONE> 或邮箱<EMAIL>谢谢"),
    ],
)
def test_chinese_mobile_numbers_and_emails_in_running_text(text, masked):
    assert mask_pii(text)[0] == masked


def test_resident_id_numbers_need_their_checksum_and_a_real_birth_date():
    assert mask_pii("身份证号11010519491231002X，") == ("身份证号<ID_NUMBER>，", Counter(id_numbers=1))
    assert mask_pii("证件 110105194912310021 无效")[1] == Counter()  # wrong check digit
    assert mask_pii("编号 110105194913310024 无效")[1] == Counter()  # month 13
    assert mask_pii("订单号2023011512345678901")[1] == Counter()  # 19 digits: not an ID, not a mobile
